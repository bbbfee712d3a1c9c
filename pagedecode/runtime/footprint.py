"""What an engine holds, in one line for the start-up log: its weights by the format they are
held in (q8_0 layers beside a float32 embedding, not "float32 weights" for a quantized model),
the compiled forward's derived copies, the KV cache's dtype, tokens and bytes, and the threads."""
from __future__ import annotations

from typing import Any


def weight_formats(model: Any, total: int) -> dict[str, int]:
    """Bytes by format (LlamaModel.weight_formats), or all of `total` under the model's dtype."""
    formats = getattr(model, "weight_formats", None)
    if callable(formats):
        return dict(formats())
    return {str(model.dtype).removeprefix("torch."): total}


def describe(engine: Any) -> str:
    """weights 130.1 MB (q8_0 98.2 MB, float32 31.9 MB), KV cache of 8192 tokens in float16
    (188.7 MB), 2 threads"""
    total = engine.weight_bytes
    formats = weight_formats(engine.model, total)
    parts = ", ".join(f"{kind} {size / 1e6:.1f} MB" for kind, size in sorted(formats.items(), key=lambda kv: -kv[1]))
    tokens = engine.kv.num_pages * engine.config.page_size
    kv_dtype = str(engine.kv_cache_dtype).removeprefix("torch.")
    return (f"weights {total / 1e6:.1f} MB ({parts}), KV cache of {tokens} tokens in {kv_dtype} "
            f"({tokens * engine.bytes_per_token_total / 1e6:.1f} MB), {engine.num_threads} threads")
