"""GGUF's block types as pagedecode keeps them in memory: sizes, and dequantization in torch that
gives exactly the floats the `gguf` package's gguf.quants.dequantize gives.

A weight (N, K) of a type is (N, K / block * type_size) uint8, each row its K / block blocks in
order, exactly as the file stores them (ggml's block_* structs, little-endian):

    type   block  bytes  layout                                              value of input j
    Q8_0     32    34    d f16 | q[32] int8                                 d * q
    Q4_0     32    18    d f16 | qs[16]: byte i = q[i] | q[i+16] << 4       d * (q - 8)
    Q4_1     32    20    d f16 | m f16 | qs[16] as Q4_0                    d * q + m
    Q5_0     32    22    d f16 | qh u32 (bit j: q[j]'s 5th bit) | qs[16]   d * (q - 16)
    Q5_1     32    24    d f16 | m f16 | qh u32 | qs[16]                   d * q + m
    Q4_K    256   144    d f16 | dmin f16 | scales[12] | qs[128]           (d * sc[s]) * q - dmin * m[s]
    Q5_K    256   176    d f16 | dmin f16 | scales[12] | qh[32] | qs[128]  (d * sc[s]) * q - dmin * m[s]
    Q6_K    256   210    ql[128] | qh[64] | scales[16] int8 | d f16        (d * sc[s]) * (q - 32)

K-quants: a super-block of 256 is 8 sub-blocks s of 32 (Q6_K: 16 of 16). Q4_K / Q5_K pack 8 six-bit
scales sc and mins m in 12 bytes: for s < 4, sc = scales[s] & 63, m = scales[s + 4] & 63; for
s >= 4, sc = scales[s + 4] & 15 | (scales[s - 4] >> 6) << 4, m = scales[s + 4] >> 4 | (scales[s] >> 6) << 4.
Q4_K's qs: 32 bytes per pair of sub-blocks, low nibbles the first, high the second. Q5_K adds
bit s of qh[l] as the 5th bit of input l of sub-block s. Q6_K: per half of 128 inputs, ql's
64 bytes and qh's 32: input l (< 32) + 32 i takes ql[l + 32 (i & 1)] >> 4 (i >> 1) low bits and
(qh[l] >> 2 i) & 3 as bits 4-5.

The float operations are gguf's, in its order (float32, no fused multiply-add), so the results are
the same bits; the tests hold every type to gguf.quants.dequantize on random blocks.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class BlockType(NamedTuple):
    block: int          # inputs per block
    type_size: int      # bytes per block


BLOCK_TYPES = {"q8_0": BlockType(32, 34), "q4_0": BlockType(32, 18), "q4_1": BlockType(32, 20),
               "q5_0": BlockType(32, 22), "q5_1": BlockType(32, 24), "q4_k": BlockType(256, 144),
               "q5_k": BlockType(256, 176), "q6_k": BlockType(256, 210)}
KINDS = tuple(BLOCK_TYPES)


def row_bytes(kind: str, k: int) -> int:
    """Bytes of one row of k inputs; ValueError unless k is a multiple of the type's block."""
    t = BLOCK_TYPES[kind]
    if k % t.block:
        raise ValueError(f"{kind} needs rows of a multiple of {t.block} inputs, got {k}")
    return k // t.block * t.type_size


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(..., 2) uint8 -> (..., 1) float32 through float16 (exact)."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(..., 16) bytes -> (..., 32): low nibbles then high nibbles, as int32."""
    qs = qs.to(torch.int32)
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """(..., 4) bytes of a little-endian u32 -> (..., 32) its bits 0..31, as int32."""
    bits = torch.arange(8, device=qh.device)
    return ((qh.to(torch.int32)[..., :, None] >> bits) & 1).flatten(-2)


def k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 scale bytes (..., 12) -> (sc, m), each (..., 8) int32 (see the docstring)."""
    s = scales.to(torch.int32)
    a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([a & 63, (c & 15) | ((a >> 6) << 4)], dim=-1)
    m = torch.cat([b & 63, (c >> 4) | ((b >> 6) << 4)], dim=-1)
    return sc, m


def dequantize(blocks: torch.Tensor, kind: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(N, K / block * type_size) uint8 -> the weight (N, K) in `dtype` (computed in float32)."""
    t = BLOCK_TYPES[kind]
    n, nbytes = blocks.shape
    nb = nbytes // t.type_size
    b = blocks.reshape(n, nb, t.type_size)
    if kind == "q8_0":
        w = b[..., 2:].contiguous().view(torch.int8).float() * _f16(b[..., :2])
    elif kind == "q4_0":
        w = _f16(b[..., :2]) * (_nibbles(b[..., 2:]) - 8).float()
    elif kind == "q4_1":
        w = _f16(b[..., :2]) * _nibbles(b[..., 4:]).float() + _f16(b[..., 2:4])
    elif kind == "q5_0":
        q = _nibbles(b[..., 6:]) | (_high_bits(b[..., 2:6]) << 4)
        w = _f16(b[..., :2]) * (q - 16).float()
    elif kind == "q5_1":
        q = _nibbles(b[..., 8:]) | (_high_bits(b[..., 4:8]) << 4)
        w = _f16(b[..., :2]) * q.float() + _f16(b[..., 2:4])
    elif kind in ("q4_k", "q5_k"):
        sc, m = k_scales(b[..., 4:16])                                     # (N, nb, 8)
        d = (_f16(b[..., 0:2]) * sc.float())[..., None]                    # (N, nb, 8, 1)
        dm = (_f16(b[..., 2:4]) * m.float())[..., None]
        qs = b[..., -128:].reshape(n, nb, 4, 32).to(torch.int32)           # 4 pairs of sub-blocks
        q = torch.stack([qs & 15, qs >> 4], dim=3).reshape(n, nb, 8, 32)
        if kind == "q5_k":
            qh = b[..., 16:48].to(torch.int32)                             # (N, nb, 32)
            q = q | (((qh[..., None, :] >> torch.arange(8, device=b.device)[:, None]) & 1) << 4)
        w = d * q.float() - dm
    elif kind == "q6_k":
        ql = b[..., :128].reshape(n, nb, 2, 64).to(torch.int32)            # 2 halves of 128 inputs
        qh = b[..., 128:192].reshape(n, nb, 2, 1, 32).to(torch.int32)
        low = torch.stack([ql & 15, ql >> 4], dim=3).reshape(n, nb, 2, 4, 32)
        high = (qh >> (2 * torch.arange(4, device=b.device))[:, None]) & 3
        q = ((low | (high << 4)) - 32).reshape(n, nb, 16, 16)
        sc = b[..., 192:208].contiguous().view(torch.int8).float()         # (N, nb, 16)
        d = (_f16(b[..., 208:210]) * sc)[..., None]
        w = d * q.float()
    else:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return w.reshape(n, nb * t.block).to(dtype)


def random_blocks(n: int, k: int, kind: str, generator: torch.Generator | None = None,
                  device: str | torch.device = "cpu", scale: float = 1 / 64) -> torch.Tensor:
    """Random blocks of an (n, k) weight for tests: every byte uniform, then each float16 field
    (d, m, dmin) set to a value of either sign with scale / 2 <= |value| < scale, so that
    every quant, scale byte and high bit occurs and every value is finite. `generator` must live
    on `device`."""
    t = BLOCK_TYPES[kind]
    nb = k // t.block
    b = torch.randint(0, 256, (n, nb, t.type_size), dtype=torch.uint8, generator=generator, device=device)
    fields = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q4_k": (0, 2),
              "q5_k": (0, 2), "q6_k": (208,)}[kind]
    for at in fields:
        v = (torch.rand(n, nb, generator=generator, device=device) + 1) * (scale / 2)
        v = torch.where(torch.rand(n, nb, generator=generator, device=device) < 0.5, -v, v)
        b[..., at:at + 2] = v.half().view(torch.uint8).view(n, nb, 2)
    return b.view(n, nb * t.type_size)
