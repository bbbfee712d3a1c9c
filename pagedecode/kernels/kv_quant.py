"""Quantized KV caches (EngineConfig.kv_cache_dtype "int8" / "fp8_e4m3"): how a K or V row is
stored and read back. The torch reference every path is held to.

One scale per (token, KV head): the block along the head dimension is the whole head (head_dim
values, one float32 scale). Why the whole head and not 32-value blocks: the scale then factors out
of both attention products, q . (s_k k_q) = s_k (q . k_q) and sum p s_v v_q = sum (p s_v) v_q, so
a kernel may attend over the raw 8-bit rows (widened) and apply one multiply per token, never
dequantizing element by element; and the scale costs 4 bytes per head_dim bytes (6 % at 64, 3 % at
128: 1.88x / 1.94x a float16 cache's tokens in the same bytes). A token's scale is computed from its
own row as the row is written and never changes, so a row's bits do not depend on the batch, the
chunk or the other tokens (prefix sharing, preemption and deterministic mode rely on that).

    int8:      scale = amax(|x|) / 127, q = round_half_even(x / scale)      in [-127, 127]
    fp8_e4m3:  scale = amax(|x|) / 448, q = float8_e4m3fn(x / scale)        (448: e4m3's largest)
    read back: x ~= float32(q) * scale                                      (an all-zero row: scale 0)

Layout (model/kv_cache.py): data (layers, pages, page_size, kv_heads, head_dim) in the 8-bit type,
scales (layers, pages, page_size, kv_heads, 1) float32 beside it, addressed by the same slots.
"""
from __future__ import annotations

import torch

# the largest magnitude each 8-bit type stores
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_DTYPE = torch.float32
# round-half-even of |y| < 2^22 in float32: adding 1.5 * 2^23 leaves no fraction bits (the same
# trick in the Triton kernel and csrc/, where there is no rint the interpreter and -O3 agree on)
ROUNDER = 12582912.0


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether a KV cache of this dtype holds 8-bit rows with a scale each."""
    return dtype in QMAX


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., head_dim) -> (q (..., head_dim) in dtype, scale (..., 1) float32), one scale per row."""
    qmax = QMAX[dtype]
    x32 = x.float()
    scale = x32.abs().amax(-1, keepdim=True) / qmax                        # (..., 1)
    y = x32 / torch.where(scale > 0, scale, 1.0)                           # |y| <= qmax (+ an ulp)
    if dtype == torch.int8:
        q = ((y + ROUNDER) - ROUNDER).clamp(-qmax, qmax).to(torch.int8)
    else:
        q = y.clamp(-qmax, qmax).to(dtype)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q (..., head_dim) 8-bit, scale (..., 1) -> the rows as `dtype` (float32 by default)."""
    return (q.float() * scale).to(dtype)
