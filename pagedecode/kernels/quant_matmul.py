"""Weight-only quantized matmul: float activations times a weight kept in GGUF's Q8_0 / Q4_0 blocks
(and, through `quant_matmul`, every other GGUF type: kernels/gguf_matmul.py).

Shapes and layout:
    x        (..., K) float32 / float16 / bfloat16, K a multiple of 32
    blocks   (N, K / 32 * BLOCK_BYTES[kind]) uint8: row n is weight row n's K / 32 blocks in order,
             each block 32 consecutive inputs, exactly as a GGUF file stores them:

        Q8_0  34 bytes   fp16 scale d | 32 x int8 q                             w[j] = d * q[j]
        Q4_0  18 bytes   fp16 scale d | 16 bytes, byte i = q[i] | q[i + 16] << 4   w[j] = d * (q[j] - 8)

    returns  (..., N) = x @ w.T in x's dtype (float32 accumulation)

Two kernels, both dequantizing in registers (the weight never exists in float in memory):
  - a GEMV for one row (single-stream decode): one program per (row, block of N outputs), looping over K
    a few blocks of 32 at a time; each block's 32 products are summed, then scaled once;
  - a GEMM for more rows (prefill): M x N tiles, the dequantized (BLOCK_K, BLOCK_N) weight tile
    fed to tl.dot, programs ordered in groups of GROUP_M row tiles so a weight tile and an
    activation tile are both reused from L2.
The scale is read through a float16 view of the same bytes (34 and 18 are even, so every
scale is 2-byte aligned) and the quants through an int8 (Q8_0) or uint8 (Q4_0) view.

Not batch-invariant: rows up to GEMV_MAX_ROWS take the GEMV, more take the GEMM, whose tile
shapes follow M; each sums a row's products in its own order.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import gguf_matmul, quant_types
from ._backend import HAS_TRITON, dot_dtype, interpreting, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    from ._backend import grouped_tile

BLOCK = 32
BLOCK_BYTES = {"q8_0": 2 + BLOCK, "q4_0": 2 + BLOCK // 2}
# rows up to this many take the GEMV, more the GEMM. Measured on an H200 (14336 x 4096, bf16): the
# GEMV's rows each re-read the weight, 4 rows took 2x one row's time, while the GEMM at 16 rows
# took 1.5x the GEMV at one
GEMV_MAX_ROWS = 1
# more rows than this: the weight is dequantized once and cuBLAS multiplies. On the H200 (14336 x
# 4096 q8_0, bf16) the GEMM / dequantize + matmul took 85 / 615 us at 16 rows, 526 / 667 at 512,
# 899 / 728 at 1,024, 3,400 / 1,200 at 4,096: the GEMM's in-loop dequantization, repeated for
# every row tile, loses past ~800 rows
GEMM_MAX_ROWS = 512


def dequantize_blocks(blocks: torch.Tensor, kind: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(N, K / block * type size) uint8 -> the weight (N, K) in `dtype`, any GGUF block type
    (kernels/quant_types.py: gguf's own arithmetic)."""
    return quant_types.dequantize(blocks, kind, dtype)


def quant_matmul_ref(x: torch.Tensor, blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """The reference: the weight dequantized to x's dtype for this call, then a plain matmul."""
    return F.linear(x, dequantize_blocks(blocks, kind, x.dtype))


def random_blocks(n: int, k: int, kind: str, generator: torch.Generator | None = None,
                  device: str | torch.device = "cpu") -> torch.Tensor:
    """Random blocks of an (n, k) weight, for tests and benchmarks: every quant byte uniform (so
    Q8_0's -128, which gguf's quantizer never writes, occurs too), scales of either sign with
    1/128 <= |d| < 1/64. `generator` must live on `device`."""
    nb = k // BLOCK
    b = torch.randint(0, 256, (n, nb, BLOCK_BYTES[kind]), dtype=torch.uint8, generator=generator, device=device)
    d = (torch.rand(n, nb, generator=generator, device=device) + 1) / 128
    d = torch.where(torch.rand(n, nb, generator=generator, device=device) < 0.5, -d, d)
    b[..., :2] = d.half().view(torch.uint8).view(n, nb, 2)
    return b.view(n, nb * BLOCK_BYTES[kind])


def _check(x: torch.Tensor, blocks: torch.Tensor, kind: str) -> None:
    if kind not in quant_types.BLOCK_TYPES:
        raise ValueError(f"kind must be one of {quant_types.KINDS}, got {kind!r}")
    K = x.shape[-1]
    t = quant_types.BLOCK_TYPES[kind]
    if K % t.block or blocks.dtype != torch.uint8 or blocks.dim() != 2 or \
            blocks.shape[1] != K // t.block * t.type_size:
        raise ValueError(f"{kind} blocks {tuple(blocks.shape)} {blocks.dtype} do not match {K} inputs")


def _views(blocks: torch.Tensor, kind: str):
    """The same bytes seen three ways: the quants (int8 for Q8_0, uint8 nibbles for Q4_0) and the
    scales (float16; element index = byte offset / 2)."""
    blocks = blocks.contiguous()
    quants = blocks.view(torch.int8) if kind == "q8_0" else blocks
    return quants, blocks.view(torch.float16)


if HAS_TRITON:
    @triton.jit
    def _gemv_kernel(x_ptr, q_ptr, d_ptr, out_ptr, N, K, stride_xm, stride_om, row_bytes,
                     Q4: tl.constexpr, BYTES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr):
        """out[m, n0:n0 + BLOCK_N] for one row m; BLOCK_KB weight blocks (32 inputs, BYTES bytes
        each) per trip."""
        m = tl.program_id(0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        row = n.to(tl.int64) * row_bytes                  # (BN,) byte offset of each weight row
        x_row = x_ptr + m.to(tl.int64) * stride_xm
        num_blocks = K // 32
        acc = tl.zeros([BLOCK_N], tl.float32)
        for kb0 in range(0, num_blocks, BLOCK_KB):
            kb = kb0 + tl.arange(0, BLOCK_KB)             # (KB,) the weight blocks of this trip
            kb_ok = kb < num_blocks
            ok = n_ok[:, None] & kb_ok[None, :]            # (BN, KB)
            block = row[:, None] + kb[None, :] * BYTES     # (BN, KB) byte offset of each block
            d = tl.load(d_ptr + block // 2, mask=ok, other=0.0).to(tl.float32)        # (BN, KB)
            if Q4:
                i = tl.arange(0, 16)
                packed = tl.load(q_ptr + block[:, :, None] + 2 + i[None, None, :], mask=ok[:, :, None],
                                 other=0)                  # (BN, KB, 16): inputs i (low) and i + 16 (high)
                lo = (packed & 15).to(tl.float32) - 8.0
                hi = (packed >> 4).to(tl.float32) - 8.0
                xk = kb[:, None] * 32 + i[None, :]        # (KB, 16)
                x_lo = tl.load(x_row + xk, mask=kb_ok[:, None], other=0.0).to(tl.float32)
                x_hi = tl.load(x_row + xk + 16, mask=kb_ok[:, None], other=0.0).to(tl.float32)
                part = tl.sum(lo * x_lo[None, :, :] + hi * x_hi[None, :, :], axis=2)   # (BN, KB)
            else:
                j = tl.arange(0, 32)
                q = tl.load(q_ptr + block[:, :, None] + 2 + j[None, None, :], mask=ok[:, :, None],
                            other=0).to(tl.float32)        # (BN, KB, 32)
                xv = tl.load(x_row + kb[:, None] * 32 + j[None, :], mask=kb_ok[:, None], other=0.0).to(tl.float32)
                part = tl.sum(q * xv[None, :, :], axis=2)  # (BN, KB)
            acc += tl.sum(part * d, axis=1)                # each block's sum scaled once
        tl.store(out_ptr + m.to(tl.int64) * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)

    @triton.jit(do_not_specialize=["M"])         # one compiled kernel for every row count (deterministic mode)
    def _gemm_kernel(x_ptr, q_ptr, d_ptr, out_ptr, M, N, K, stride_xm, stride_om, row_bytes,
                     Q4: tl.constexpr, BYTES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_DTYPE: tl.constexpr):
        """out[m0:m0 + BLOCK_M, n0:n0 + BLOCK_N]; BLOCK_K a multiple of 32 (whole weight blocks)."""
        pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm        # (BM, 1)
        row = rn.to(tl.int64) * row_bytes                              # (BN,) byte offset of each weight row
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)                 # (BK,) input index
            k_ok = k < K
            a = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            #   input k sits in block k // 32 at position j = k % 32; Q4_0 keeps j and j + 16 in byte j % 16
            block = (k // 32) * BYTES                      # (BK,) byte offset of its block in a row
            j = k % 32
            ok = k_ok[:, None] & n_ok[None, :]             # (BK, BN)
            d = tl.load(d_ptr + (row[None, :] + block[:, None]) // 2, mask=ok, other=0.0).to(tl.float32)
            if Q4:
                packed = tl.load(q_ptr + row[None, :] + (block + 2 + j % 16)[:, None], mask=ok, other=0)
                q = tl.where((j < 16)[:, None], packed & 15, packed >> 4).to(tl.float32) - 8.0
            else:
                q = tl.load(q_ptr + row[None, :] + (block + 2 + j)[:, None], mask=ok, other=0).to(tl.float32)
            w = (q * d).to(DOT_DTYPE)                      # (BK, BN) the dequantized weight tile
            if DOT_DTYPE == tl.float32:                    # float32 stays exact (no TF32), as torch's matmul
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a.to(DOT_DTYPE), w, acc)
        tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


def gemv_config() -> dict:
    """BLOCK_N outputs per program, BLOCK_K inputs per trip (a power of two number of blocks);
    one config whatever K, so one compile per dtype."""
    if interpreting():                      # few, large programs: the interpreter pays per program
        return dict(block_n=64, block_k=128, num_warps=4)
    return dict(block_n=4, block_k=256, num_warps=1)      # the H200 sweep's best of 30 (both kinds)


def gemm_config(M: int) -> dict:
    if interpreting():
        return dict(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=1)
    if M <= 32:                             # small batches: narrow N tiles, so enough programs
        return dict(block_m=16 if M <= 16 else 32, block_n=32, block_k=128, num_warps=4, num_stages=4)
    return dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)   # the H200 sweep's best of 2


def quant_gemv_triton(x: torch.Tensor, blocks: torch.Tensor, kind: str, out: torch.Tensor,
                      block_n: int, block_k: int, num_warps: int = 4) -> torch.Tensor:
    """x (M, K) contiguous rows, out (M, N). Launch parameters are arguments for the sweep."""
    M, K = x.shape
    N = blocks.shape[0]
    assert block_k % BLOCK == 0 and triton.next_power_of_2(block_k // BLOCK) == block_k // BLOCK
    quants, scales = _views(blocks, kind)
    _gemv_kernel[(M, triton.cdiv(N, block_n))](
        x, quants, scales, out, N, K, x.stride(0), out.stride(0), blocks.shape[1],
        Q4=kind == "q4_0", BYTES=BLOCK_BYTES[kind], BLOCK_N=block_n, BLOCK_KB=block_k // BLOCK, num_warps=num_warps)
    return out


def quant_gemm_triton(x: torch.Tensor, blocks: torch.Tensor, kind: str, out: torch.Tensor,
                      block_m: int, block_n: int, block_k: int, num_warps: int = 4, num_stages: int = 3,
                      group_m: int = 8) -> torch.Tensor:
    M, K = x.shape
    N = blocks.shape[0]
    assert min(block_m, block_n, block_k) >= 16 and block_k % BLOCK == 0    # tl.dot: tiles >= 16
    quants, scales = _views(blocks, kind)
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    _gemm_kernel[grid](
        x, quants, scales, out, M, N, K, x.stride(0), out.stride(0), blocks.shape[1],
        Q4=kind == "q4_0", BYTES=BLOCK_BYTES[kind], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        DOT_DTYPE=dot_dtype(x), num_warps=num_warps, num_stages=num_stages)
    return out


def quant_matmul_triton(x: torch.Tensor, blocks: torch.Tensor, kind: str,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) -> (..., N) through the GEMV (up to GEMV_MAX_ROWS rows), the GEMM, or past
    GEMM_MAX_ROWS the weight dequantized once and a plain matmul; `out`
    (rows, N) contiguous, if given, receives the result (tests poison it with NaN)."""
    _check(x, blocks, kind)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()                      # (M, K)
    M, N = x2.shape[0], blocks.shape[0]
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    assert out.shape == (M, N) and out.stride(1) == 1 and out.dtype == x.dtype
    if M == 0:
        pass
    elif M <= GEMV_MAX_ROWS:
        quant_gemv_triton(x2, blocks, kind, out, **gemv_config())
    elif M > GEMM_MAX_ROWS:
        torch.matmul(x2, dequantize_blocks(blocks, kind, x.dtype).t(), out=out)
    else:
        quant_gemm_triton(x2, blocks, kind, out, **gemm_config(M))
    return out.view(*x.shape[:-1], N)


def deterministic_gemm_config() -> dict:
    """Deterministic mode's one GEMM config for every row count (the GEMV for one row and
    dequantize + matmul past GEMM_MAX_ROWS reduce in other orders than the GEMM)."""
    if interpreting():
        return dict(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=1)
    return dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4)    # compiled in the sweep


def quant_matmul_deterministic(x: torch.Tensor, blocks: torch.Tensor, kind: str, backend: str = "auto") -> torch.Tensor:
    """x @ w.T with one reduction order over K for every row count: always the GEMM, always
    deterministic_gemm_config's tiles (row i is the same bits for 1 row or 4,096). The
    reference elsewhere (which is not batch-invariant on CPU); the other GGUF types through
    kernels/gguf_matmul.py's GEMM, likewise with one config."""
    if kind in gguf_matmul.KINDS and use_triton(x, backend):
        return gguf_matmul.gguf_matmul_deterministic(x, blocks, kind)
    if kind not in BLOCK_BYTES or not use_triton(x, backend):
        return quant_matmul(x, blocks, kind, backend)
    _check(x, blocks, kind)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty((x2.shape[0], blocks.shape[0]), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        quant_gemm_triton(x2, blocks, kind, out, **deterministic_gemm_config())
    return out.view(*x.shape[:-1], blocks.shape[0])


def quant_matmul(x: torch.Tensor, blocks: torch.Tensor, kind: str, backend: str = "auto") -> torch.Tensor:
    """x @ w.T for a weight in `kind` blocks (see the module docstring): Triton on CUDA tensors
    (Q8_0 / Q4_0 here, every other GGUF type by kernels/gguf_matmul.py), the dequantizing
    reference elsewhere (backend as in kernels/_backend.py)."""
    if kind in BLOCK_BYTES and use_triton(x, backend):
        return quant_matmul_triton(x, blocks, kind)
    if kind in gguf_matmul.KINDS and use_triton(x, backend):
        return gguf_matmul.gguf_matmul_triton(x, blocks, kind)
    _check(x, blocks, kind)
    return quant_matmul_ref(x, blocks, kind)
