"""`pagedecode export-tokenizer MODEL DIR`: the model's tokenizer as Hugging Face files
(tokenizer.json, tokenizer_config.json with the chat template and the special tokens), so that
tools built on transformers' AutoTokenizer (lm-eval's tokenizer, guidellm, aiperf) run against a
model that is only a GGUF file. For a GGUF the tokenizer is the one pagedecode builds from its
metadata (gguf_tokenizer.py): the exported files encode to the ids the engine uses."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..errors import ModelLoadError
from .gguf_file import chat_template, is_gguf, read_metadata
from .gguf_tokenizer import build_tokenizer

EXPORTED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def export_tokenizer(model: str | Path, out: str | Path) -> list[Path]:
    """Write `model`'s tokenizer files into `out` (made if missing); returns the files written.
    A Hugging Face directory's own files are copied as they are."""
    model, out = Path(model), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if model.is_dir():
        copied = [shutil.copy(model / name, out / name) for name in EXPORTED if (model / name).is_file()]
        if not (out / "tokenizer.json").is_file():
            raise ModelLoadError(f"{model} holds no tokenizer.json to export")
        return [Path(p) for p in copied]
    if not is_gguf(model):
        raise ModelLoadError(f"{model} is neither a GGUF file nor a model directory")
    meta = read_metadata(model)
    tok = build_tokenizer(meta)
    template, specials = chat_template(model)
    tok.save(out / "tokenizer.json")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **{k: v for k, v in specials.items() if v is not None},
              "add_bos_token": bool(tok.add_bos), "add_eos_token": bool(tok.add_eos),
              "clean_up_tokenization_spaces": False}
    arch = meta.get("general.architecture")
    context = meta.get(f"{arch}.context_length")
    if context is not None:
        config["model_max_length"] = int(context)
    if template:
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return [out / "tokenizer.json", out / "tokenizer_config.json"]
