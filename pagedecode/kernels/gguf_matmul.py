"""Weight-only matmul for GGUF's other block types: Q4_1, Q5_0, Q5_1 (blocks of 32 inputs) and the
K-quants Q4_K, Q5_K, Q6_K (super-blocks of 256), beside kernels/quant_matmul.py's Q8_0 / Q4_0.

Shapes and layout (kernels/quant_types.py draws each block):
    x        (..., K) float32 / float16 / bfloat16, K a multiple of the type's block (32 or 256)
    blocks   (N, K / block * type size) uint8: row n is weight row n's blocks in order, as the file
             stores them
    returns  (..., N) = x @ w.T in x's dtype (float32 accumulation)

Three device functions hold gguf's formulas: `_block_base` (where input k's block starts),
`_scale_offset` (its (sub-)block's scale and offset: w = scale * q + offset) and `_quant` (its
quant, less the type's zero point); `_weight` puts them together for any (row, input) pairs. They
read the block's float16 fields through a float16 view of the same bytes (every type's size is
even and its float16 fields sit at even offsets, so each is 2-byte aligned) and the quants, high
bits and packed sub-scales through a uint8 view. Every kernel below dequantizes in registers (the
weight never exists in float in memory):
  - a GEMV for one row (single-stream decode): one program per (row, BLOCK_N outputs), BLOCK_K
    inputs a trip as sub-blocks (32 inputs sharing a scale; Q6_K's 16): each sub-block's quants
    times x summed, then scaled once, plus its offset times the sub-block's sum of x, so the
    scales are read once per sub-block;
  - a GEMM for more rows (prefill): M x N tiles, the dequantized (BLOCK_K, BLOCK_N) weight tile fed
    to tl.dot, programs in groups of GROUP_M row tiles (as quant_matmul.py's GEMM; here each
    weight reads its scale, cached: the factoring the GEMV does is the next step if a GPU sweep
    finds the GEMM's loads the limit);
  - a dequantizing kernel for long prefills (more than GEMM_MAX_ROWS rows), whose float weight a
    plain matmul then takes; in float32 it is gguf's dequantization bit for bit (the tests hold it
    to quant_types.dequantize, which is held to gguf).
The references: `gguf_matmul_ref` (the weight dequantized by quant_types for the call, then
F.linear), and quant_types.dequantize for the dequantizing kernel.

Not batch-invariant (the GEMV and the GEMM sum in different orders); deterministic mode takes the
GEMM with one config for every row count (gguf_matmul_deterministic). Launch configurations are
the Q8_0 / Q4_0 kernels' measured ones, not yet swept for these types
(benchmarks/kernel_sweep.py --quant times them on a GPU).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import quant_types
from ._backend import HAS_TRITON, dot_dtype, interpreting

if HAS_TRITON:
    import triton
    import triton.language as tl

    from ._backend import grouped_tile

KINDS = ("q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
# rows up to this many take the GEMV, more the GEMM, past GEMM_MAX_ROWS dequantize + matmul (the
# thresholds quant_matmul.py measured for Q8_0 on an H200)
GEMV_MAX_ROWS = 1
GEMM_MAX_ROWS = 512


def gguf_matmul_ref(x: torch.Tensor, blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """The reference: the weight dequantized to x's dtype for this call, then a plain matmul."""
    return F.linear(x, quant_types.dequantize(blocks, kind, x.dtype))


if HAS_TRITON:
    @triton.jit
    def _k_scale_min(q_ptr, scales, s):
        """Q4_K / Q5_K: sub-block s's six-bit scale and min from the 12 bytes at `scales`:
        s < 4: sc = b[s] & 63, m = b[s + 4] & 63; s >= 4: sc = b[s + 4] & 15 | (b[s - 4] >> 6) << 4,
        m = b[s + 4] >> 4 | (b[s] >> 6) << 4 (elementwise; every address lies in the 12 bytes)."""
        first = s < 4
        b1 = tl.load(q_ptr + scales + tl.where(first, s, s + 4)).to(tl.int32)
        b2 = tl.load(q_ptr + scales + tl.where(first, s + 4, s - 4)).to(tl.int32)
        b3 = tl.load(q_ptr + scales + s).to(tl.int32)
        sc = tl.where(first, b1 & 63, (b1 & 15) | ((b2 >> 6) << 4))
        mn = tl.where(first, b2 & 63, (b1 >> 4) | ((b3 >> 6) << 4))
        return sc, mn

    @triton.jit
    def _block_base(row, k, ok, KIND: tl.constexpr):
        """Byte offset of the block holding input k of the weight row at byte `row`, and k's place j
        in it; masked-off elements point at the first block (always there), so loads need no mask."""
        if KIND == "q4_1":
            return tl.where(ok, row + (k // 32) * 20, 0), k % 32
        elif KIND == "q5_0":
            return tl.where(ok, row + (k // 32) * 22, 0), k % 32
        elif KIND == "q5_1":
            return tl.where(ok, row + (k // 32) * 24, 0), k % 32
        elif KIND == "q4_k":
            return tl.where(ok, row + (k // 256) * 144, 0), k % 256
        elif KIND == "q5_k":
            return tl.where(ok, row + (k // 256) * 176, 0), k % 256
        else:
            tl.static_assert(KIND == "q6_k")
            return tl.where(ok, row + (k // 256) * 210, 0), k % 256

    @triton.jit
    def _scale_offset(q_ptr, h_ptr, base, j, KIND: tl.constexpr):
        """(scale, offset) in float32 of input j's (sub-)block at byte `base`: w = scale * q + offset,
        q from _quant (offset unused, zeros, for Q5_0 and Q6_K). The products are
        quant_types.dequantize's: d * sc and dmin * m for the K-quants (offset = -(dmin * m): adding
        it is subtracting dmin * m, bit for bit)."""
        d = tl.load(h_ptr + base // 2).to(tl.float32)
        if KIND == "q4_1" or KIND == "q5_1":                   # d f16 | m f16 | ...
            return d, tl.load(h_ptr + base // 2 + 1).to(tl.float32)
        elif KIND == "q4_k" or KIND == "q5_k":                 # d | dmin | scales[12] | ...
            sc, mn = _k_scale_min(q_ptr, base + 4, j // 32)
            return d * sc.to(tl.float32), -(tl.load(h_ptr + base // 2 + 1).to(tl.float32) * mn.to(tl.float32))
        elif KIND == "q6_k":                                   # ... | scales[16] int8 | d f16 (at 208)
            sc = tl.load(q_ptr + base + 192 + j // 16).to(tl.int32)
            sc = tl.where(sc > 127, sc - 256, sc)              # the sub-scale is int8
            return tl.load(h_ptr + (base + 208) // 2).to(tl.float32) * sc.to(tl.float32), tl.zeros_like(d)
        else:
            tl.static_assert(KIND == "q5_0")
            return d, tl.zeros_like(d)

    @triton.jit
    def _quant(q_ptr, base, j, KIND: tl.constexpr):
        """Input j's quant (int32) in the block at byte `base`, less the type's zero point (Q5_0's 16,
        Q6_K's 32)."""
        if KIND == "q4_1":                                     # d | m | qs[16]: byte i = q[i] | q[i + 16] << 4
            byte = tl.load(q_ptr + base + 4 + j % 16).to(tl.int32)
            return tl.where(j < 16, byte & 15, byte >> 4)
        elif KIND == "q5_0":                                   # d | qh u32 (bit j: q[j]'s 5th bit) | qs[16]
            high = (tl.load(q_ptr + base + 2 + j // 8).to(tl.int32) >> (j % 8)) & 1
            byte = tl.load(q_ptr + base + 6 + j % 16).to(tl.int32)
            return (tl.where(j < 16, byte & 15, byte >> 4) | (high << 4)) - 16
        elif KIND == "q5_1":                                   # d | m | qh u32 | qs[16]
            high = (tl.load(q_ptr + base + 4 + j // 8).to(tl.int32) >> (j % 8)) & 1
            byte = tl.load(q_ptr + base + 8 + j % 16).to(tl.int32)
            return tl.where(j < 16, byte & 15, byte >> 4) | (high << 4)
        elif KIND == "q4_k":                                   # qs: pairs of sub-blocks (2p, 2p + 1) in 32
            byte = tl.load(q_ptr + base + 16 + (j // 64) * 32 + j % 32).to(tl.int32)   # bytes, low nibbles
            return tl.where((j // 32) % 2 == 0, byte & 15, byte >> 4)                   # the first
        elif KIND == "q5_k":                                   # Q4_K's qs at 48, and bit s (the sub-block)
            byte = tl.load(q_ptr + base + 48 + (j // 64) * 32 + j % 32).to(tl.int32)   # of qh[j % 32] at 16
            high = (tl.load(q_ptr + base + 16 + j % 32).to(tl.int32) >> (j // 32)) & 1
            return tl.where((j // 32) % 2 == 0, byte & 15, byte >> 4) | (high << 4)
        else:                                                  # q6_k: ql[128] | qh[64] | ...
            tl.static_assert(KIND == "q6_k")
            half = j // 128                                    # halves of 128: ql 64 bytes, qh 32
            quarter = (j % 128) // 32                          # input l + 32 i of a half: ql[l + 32 (i & 1)]
            lane = j % 32                                      #   >> 4 (i >> 1), qh[l] >> 2 i
            low = (tl.load(q_ptr + base + half * 64 + lane + 32 * (quarter % 2)).to(tl.int32)
                   >> (4 * (quarter // 2))) & 15
            high = (tl.load(q_ptr + base + 128 + half * 32 + lane).to(tl.int32) >> (2 * quarter)) & 3
            return (low | (high << 4)) - 32

    @triton.jit
    def _weight(q_ptr, h_ptr, row, k, ok, KIND: tl.constexpr):
        """w at weight-row byte offsets `row` (int64) and inputs `k`, broadcast together, in float32;
        0 where `ok` is false. q_ptr: the blocks as uint8, h_ptr: the same bytes as float16 (element
        = byte offset / 2). The float operations are quant_types.dequantize's, in its order."""
        base, j = _block_base(row, k, ok, KIND)
        scale, offset = _scale_offset(q_ptr, h_ptr, base, j, KIND)
        w = scale * _quant(q_ptr, base, j, KIND).to(tl.float32)
        if KIND != "q5_0" and KIND != "q6_k":
            w = w + offset
        return tl.where(ok, w, 0.0)

    @triton.jit
    def _gemv_kernel(x_ptr, q_ptr, h_ptr, out_ptr, N, K, stride_xm, stride_om, row_bytes,
                     KIND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr):
        """out[m, n0:n0 + BLOCK_N] for one row m. A trip takes BLOCK_K / SUB sub-blocks (SUB inputs
        sharing one scale and offset: 32, Q6_K's 16): the quants times x summed per sub-block, then
        scaled once, plus offset x the sub-block's sum of x (the scale and offset read once per
        sub-block, not per weight)."""
        SUBS: tl.constexpr = BLOCK_K // SUB
        m = tl.program_id(0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        row = n.to(tl.int64) * row_bytes                       # (BN,) byte offset of each weight row
        x_row = x_ptr + m.to(tl.int64) * stride_xm
        acc = tl.zeros([BLOCK_N, SUBS], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            first = k0 + tl.arange(0, SUBS) * SUB               # (S,) each sub-block's first input
            k = first[:, None] + tl.arange(0, SUB)[None, :]     # (S, SUB)
            k_ok = k < K                                        # K is whole blocks: a sub-block is in or out
            xv = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)                     # (S, SUB)
            ok = n_ok[:, None] & (first < K)[None, :]                                         # (BN, S)
            base, j = _block_base(row[:, None], first[None, :], ok, KIND)                     # (BN, S)
            scale, offset = _scale_offset(q_ptr, h_ptr, base, j, KIND)
            q = _quant(q_ptr, base[:, :, None], j[:, :, None] + tl.arange(0, SUB)[None, None, :], KIND)  # (BN, S, SUB)
            part = tl.sum(q.to(tl.float32) * xv[None, :, :], axis=2)                          # (BN, S)
            if KIND != "q5_0" and KIND != "q6_k":
                part = part * scale + offset * tl.sum(xv, axis=1)[None, :]
            else:
                part = part * scale
            acc += tl.where(ok, part, 0.0)
        tl.store(out_ptr + m.to(tl.int64) * stride_om + n, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty),
                 mask=n_ok)

    @triton.jit(do_not_specialize=["M"])         # one compiled kernel for every row count (deterministic mode)
    def _gemm_kernel(x_ptr, q_ptr, h_ptr, out_ptr, M, N, K, stride_xm, stride_om, row_bytes,
                     KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, DOT_DTYPE: tl.constexpr):
        """out[m0:m0 + BLOCK_M, n0:n0 + BLOCK_N]."""
        pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm        # (BM, 1)
        row = rn.to(tl.int64) * row_bytes                              # (BN,)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            a = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            w = _weight(q_ptr, h_ptr, row[None, :], k[:, None], k_ok[:, None] & n_ok[None, :], KIND)   # (BK, BN)
            if DOT_DTYPE == tl.float32:                    # float32 stays exact (no TF32), as torch's matmul
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a.to(DOT_DTYPE), w.to(DOT_DTYPE), acc)
        tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _dequantize_kernel(q_ptr, h_ptr, out_ptr, N, K, row_bytes, stride_on,
                           KIND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """out[n tile, k tile] = the weight, in out's dtype."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        ok = (n < N)[:, None] & (k < K)[None, :]
        w = _weight(q_ptr, h_ptr, n.to(tl.int64)[:, None] * row_bytes, k[None, :], ok, KIND)
        tl.store(out_ptr + n.to(tl.int64)[:, None] * stride_on + k[None, :], w.to(out_ptr.dtype.element_ty), mask=ok)


def gemv_config() -> dict:
    if interpreting():                      # few, large programs: the interpreter pays per program
        return dict(block_n=64, block_k=128, num_warps=4)
    return dict(block_n=4, block_k=256, num_warps=1)


def gemm_config(M: int) -> dict:
    if interpreting():
        return dict(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=1)
    if M <= 32:                             # small batches: narrow N tiles, so enough programs
        return dict(block_m=16 if M <= 16 else 32, block_n=32, block_k=128, num_warps=4, num_stages=4)
    return dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)


def deterministic_gemm_config() -> dict:
    """Deterministic mode's one GEMM config for every row count."""
    if interpreting():
        return dict(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=1)
    return dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4)


def _check(x: torch.Tensor, blocks: torch.Tensor, kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    t = quant_types.BLOCK_TYPES[kind]
    K = x.shape[-1]
    if K % t.block or blocks.dtype != torch.uint8 or blocks.dim() != 2 or \
            blocks.shape[1] != K // t.block * t.type_size:
        raise ValueError(f"{kind} blocks {tuple(blocks.shape)} {blocks.dtype} do not match {K} inputs")


def _views(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same bytes as uint8 (quants, bits, sub-scales) and float16 (element = byte offset / 2)."""
    blocks = blocks.contiguous()
    return blocks, blocks.view(torch.float16)


def gguf_gemv_triton(x: torch.Tensor, blocks: torch.Tensor, kind: str, out: torch.Tensor,
                     block_n: int, block_k: int, num_warps: int = 4) -> torch.Tensor:
    """x (M, K) contiguous rows, out (M, N); each row through the GEMV."""
    M, K = x.shape
    N = blocks.shape[0]
    sub = 16 if kind == "q6_k" else 32                          # inputs sharing a scale
    assert block_k % sub == 0 and triton.next_power_of_2(block_k) == block_k
    quants, halves = _views(blocks)
    _gemv_kernel[(M, triton.cdiv(N, block_n))](
        x, quants, halves, out, N, K, x.stride(0), out.stride(0), blocks.shape[1],
        KIND=kind, BLOCK_N=block_n, BLOCK_K=block_k, SUB=sub, num_warps=num_warps)
    return out


def gguf_gemm_triton(x: torch.Tensor, blocks: torch.Tensor, kind: str, out: torch.Tensor,
                     block_m: int, block_n: int, block_k: int, num_warps: int = 4, num_stages: int = 3,
                     group_m: int = 8) -> torch.Tensor:
    M, K = x.shape
    N = blocks.shape[0]
    assert min(block_m, block_n, block_k) >= 16                # tl.dot: tiles >= 16
    quants, halves = _views(blocks)
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    _gemm_kernel[grid](
        x, quants, halves, out, M, N, K, x.stride(0), out.stride(0), blocks.shape[1],
        KIND=kind, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        DOT_DTYPE=dot_dtype(x), num_warps=num_warps, num_stages=num_stages)
    return out


def gguf_dequantize_triton(blocks: torch.Tensor, kind: str, dtype: torch.dtype = torch.float32,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """(N, K / block * type size) uint8 -> the weight (N, K) in `dtype`, by the kernels' `_weight`."""
    t = quant_types.BLOCK_TYPES[kind]
    N, K = blocks.shape[0], blocks.shape[1] // t.type_size * t.block
    if out is None:
        out = torch.empty((N, K), dtype=dtype, device=blocks.device)
    assert out.shape == (N, K) and out.stride(1) == 1
    quants, halves = _views(blocks)
    block_n, block_k = (64, 256) if interpreting() else (16, 256)
    if N:
        _dequantize_kernel[(triton.cdiv(N, block_n), triton.cdiv(K, block_k))](
            quants, halves, out, N, K, blocks.shape[1], out.stride(0), KIND=kind, BLOCK_N=block_n, BLOCK_K=block_k,
            enable_fp_fusion=False)        # d * q + m as two roundings, as gguf: the same bits on the GPU too
    return out


def gguf_matmul_triton(x: torch.Tensor, blocks: torch.Tensor, kind: str,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) -> (..., N): the GEMV up to GEMV_MAX_ROWS rows, the GEMM up to GEMM_MAX_ROWS, past
    that the weight dequantized once by the kernel and a plain matmul; `out` (rows, N) contiguous,
    if given, receives the result (tests poison it with NaN)."""
    _check(x, blocks, kind)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()                      # (M, K)
    M, N = x2.shape[0], blocks.shape[0]
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    assert out.shape == (M, N) and out.stride(1) == 1 and out.dtype == x.dtype
    if M == 0:
        pass
    elif M <= GEMV_MAX_ROWS:
        gguf_gemv_triton(x2, blocks, kind, out, **gemv_config())
    elif M > GEMM_MAX_ROWS:
        torch.matmul(x2, gguf_dequantize_triton(blocks, kind, x.dtype).t(), out=out)
    else:
        gguf_gemm_triton(x2, blocks, kind, out, **gemm_config(M))
    return out.view(*x.shape[:-1], N)


def gguf_matmul_deterministic(x: torch.Tensor, blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """x @ w.T with one reduction order over K for every row count: always the GEMM with
    deterministic_gemm_config's tiles."""
    _check(x, blocks, kind)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty((x2.shape[0], blocks.shape[0]), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        gguf_gemm_triton(x2, blocks, kind, out, **deterministic_gemm_config())
    return out.view(*x.shape[:-1], blocks.shape[0])
