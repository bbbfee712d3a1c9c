"""Quantized KV caches (EngineConfig.kv_cache_dtype "int8" / "fp8_e4m3"): how a K or V row is
stored and read back. The torch reference every path is held to.

One scale per (token, KV head): the block along the head dimension is the whole head (head_dim
values, one bfloat16 scale). Why the whole head and not 32-value blocks: the scale then factors out
of both attention products, q . (s_k k_q) = s_k (q . k_q) and sum p s_v v_q = sum (p s_v) v_q, so
a kernel may attend over the raw 8-bit rows (widened) and apply one multiply per token, never
dequantizing element by element; and the scale costs 2 bytes per head_dim bytes (3 % at 64, 1.6 %
at 128: 1.94x / 1.97x a float16 cache's tokens in the same bytes; a float32 scale made it 1.88x at
64). Bfloat16 and not float16: float32's range, so no row's scale overflows or flushes to zero.
The scale is computed in float32, rounded to bfloat16 (to nearest even) and the row quantized
against the rounded value, so what is stored is what was used; its 8 significant bits cost
nothing measurable (int8's largest value still lands within half a step of 127). A token's scale
is computed from its own row as the row is written and never changes, so a row's bits do not
depend on the batch, the chunk or the other tokens (prefix sharing, preemption and deterministic
mode rely on that).

    int8:      scale = bf16(amax(|x|) / 127), q = round_half_even(x / scale) in [-127, 127]
    fp8_e4m3:  scale = bf16(amax(|x|) / 448 * (1 + j / FP8_STEPS)), q = e4m3(x / scale), for the j
               in 0 .. FP8_STEPS - 1 whose row reads back closest (least squared error, in
               float64; the first such j)
    read back: x ~= float32(q) * float32(scale)                             (an all-zero row: scale 0)
    (bf16: to bfloat16, nearest even; all arithmetic in float32)

Why fp8 searches its scale and int8 does not: e4m3 keeps 3 mantissa bits, so its error is
relative (up to 1/16 of each value) and falls mostly on a row's few largest values (K's outlier
channels), which decide q . k; where they land on e4m3's grid depends on the scale's mantissa, so
trying FP8_STEPS scales within one binade and keeping the best lowers SmolLM2's KL against a
float32 cache from 4.6e-3 to ~2.6e-3 (benchmarks/kv_quant.py). A larger int8 scale only coarsens
its uniform grid (and a smaller one clips the largest value): amax / 127 was the best of every
scale tried. The search costs only the write; readers are unchanged.

e4m3's rounding is computed here in float32 arithmetic (e4m3_round: the exponent from the bits, a
power-of-two step, half-to-even), the same in the Triton kernel, and the result, exact in e4m3,
is then converted: the Triton interpreter rounds ~2 % of float -> e4m3 conversions wrongly
(/work/shared/KERNELS.md), an exact value it converts right, so every path picks the same scale.

Layout (model/kv_cache.py): data (layers, pages, page_size, kv_heads, head_dim) in the 8-bit type,
scales (layers, pages, page_size, kv_heads, 1) bfloat16 beside it, addressed by the same slots.
"""
from __future__ import annotations

import torch

# the largest magnitude each 8-bit type stores
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_DTYPE = torch.bfloat16
# round-half-even of |y| < 2^22 in float32: adding 1.5 * 2^23 leaves no fraction bits (the same
# trick in the Triton kernel and csrc/, where there is no rint the interpreter and -O3 agree on)
ROUNDER = 12582912.0
# the fp8 scales tried per row: amax / 448 times 1, 1 + 1/16, ..., 1 + 15/16 (each exact in float32)
FP8_STEPS = 16


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether a KV cache of this dtype holds 8-bit rows with a scale each."""
    return dtype in QMAX


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., head_dim) -> (q (..., head_dim) in dtype, scale (..., 1) SCALE_DTYPE), one scale per row."""
    qmax = QMAX[dtype]
    x32 = x.float()
    base = x32.abs().amax(-1, keepdim=True) / qmax                         # (..., 1)
    if dtype != torch.int8:
        return fp8_best_scale(x32, base, dtype)
    scale = stored_scale(base)
    y = x32 / torch.where(scale > 0, scale, 1.0)                           # |y| <= qmax (+ a rounding)
    q = ((y.clamp(-qmax, qmax) + ROUNDER) - ROUNDER).to(torch.int8)
    return q, scale.to(SCALE_DTYPE)


def stored_scale(s: torch.Tensor) -> torch.Tensor:
    """float32 s >= 0 -> the bfloat16 value the cache stores for it (nearest even), as float32."""
    return s.to(SCALE_DTYPE).float()


def e4m3_round(y: torch.Tensor) -> torch.Tensor:
    """float32 y, |y| <= 448 -> the nearest float8_e4m3fn value (ties to even), as float32: the
    step is 2^(e - 3) for y's binary exponent e (at least -6, e4m3's smallest normal: below it the
    subnormals' step 2^-9)."""
    e = ((y.view(torch.int32) >> 23) & 0xFF).clamp(min=127 - 6)            # biased exponent, >= 2^-6
    up = ((127 + 127 + 3 - e) << 23).view(torch.float32)                    # 2^(3 - e)
    step = ((e - 3) << 23).view(torch.float32)                              # 2^(e - 3)
    return ((y * up + ROUNDER) - ROUNDER) * step


def fp8_best_scale(x32: torch.Tensor, base: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8 rows and scales: of bf16(base * (1 + j / FP8_STEPS)), the scale whose row reads back
    with the least squared error (the first on a tie)."""
    qmax = QMAX[dtype]
    x64 = x32.double()
    best_q, best_s, best_e = torch.empty(0), base, torch.full_like(x64[..., :1], float("inf"))
    for j in range(FP8_STEPS):
        s = stored_scale(base * (1.0 + j / FP8_STEPS))
        q = e4m3_round((x32 / torch.where(s > 0, s, 1.0)).clamp(-qmax, qmax))
        err = ((q.double() * s.double() - x64) ** 2).sum(-1, keepdim=True)
        better = err < best_e                          # the first j on a tie
        best_q = q if j == 0 else torch.where(better, q, best_q)
        best_s, best_e = torch.where(better, s, best_s), torch.where(better, err, best_e)
    return best_q.to(dtype), best_s.to(SCALE_DTYPE)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q (..., head_dim) 8-bit, scale (..., 1) -> the rows as `dtype` (float32 by default)."""
    return (q.float() * scale.float()).to(dtype)
