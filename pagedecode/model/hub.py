"""Models by name: `--model ORG/NAME` (a Hugging Face repository of a safetensors checkpoint) or
`--model ORG/NAME:FILE.gguf` (one file of a GGUF repository), fetched through huggingface_hub
into its cache (HF_HUB_CACHE, HF_HOME), with its progress bars on a terminal, then loaded as the
local path it is there. A path that exists is always taken as a path. Offline (HF_HUB_OFFLINE=1,
or no network) a name that is cached loads from the cache; one that is not is one line saying
where it was looked for."""
from __future__ import annotations

import re
import sys
from pathlib import Path

from ..errors import ModelLoadError

# what a checkpoint directory needs (not other formats' weights: .bin, .onnx, .gguf, ...)
CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]
_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(:[^/:]+)?$")


def is_hub_name(model: str | Path) -> bool:
    """ORG/NAME or ORG/NAME:FILE that is not an existing path."""
    text = str(model)
    return not Path(text).exists() and _NAME.match(text) is not None


def resolve_model(model: str | Path) -> Path:
    """The local path of `model`: itself when it is not a hub name, else the cached (downloaded
    first when needed) checkpoint directory or GGUF file."""
    if not is_hub_name(model):
        return Path(model)
    repo, _, file = str(model).partition(":")
    if file and not file.endswith(".gguf"):
        raise ModelLoadError(f"--model {model}: after ':' give the repository's GGUF file name (FILE.gguf)")
    try:
        import huggingface_hub
        from huggingface_hub import constants, errors
        from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    except ImportError:
        raise ModelLoadError(f"--model {model} names a Hugging Face repository: pip install huggingface_hub") from None
    quiet = not sys.stderr.isatty() and not are_progress_bars_disabled()
    if quiet:                       # progress bars on a terminal only
        disable_progress_bars()
    try:
        if file:
            return Path(huggingface_hub.hf_hub_download(repo, file))
        return Path(str(huggingface_hub.snapshot_download(repo, allow_patterns=CHECKPOINT_FILES)))
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled):
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub could not be reached"
        raise ModelLoadError(f"{model}: not in the Hugging Face cache at {constants.HF_HUB_CACHE} and nothing could "
                             f"be downloaded ({why})") from None
    except (errors.RepositoryNotFoundError, errors.GatedRepoError) as e:
        raise ModelLoadError(f"{model}: no such repository, or one that needs a token (HF_TOKEN): "
                             f"{str(e).splitlines()[0]}") from None
    except errors.EntryNotFoundError:
        raise ModelLoadError(f"{model}: the repository has no file {file}") from None
    except errors.HfHubHTTPError as e:
        raise ModelLoadError(f"{model}: the download failed: {str(e).splitlines()[0]}") from None
    finally:
        if quiet:
            enable_progress_bars()
