"""Batch-invariant matmul for deterministic mode: y = x @ w.T (+ b), as F.linear.

Shapes:
    x        (..., K) float32 / bfloat16 / float16, the activations (M rows once flattened)
    w        (N, K) contiguous, the weight as checkpoints store it
    b        (N,) or None
    returns  (..., N) in x's dtype (accumulated in float32)

cuBLAS picks its algorithm (tile sizes, split-K) by shape, so a row's result depends on how
many other rows share the call: a decode step of 3 requests and one of 40 round the same row
differently. Here every output is reduced over K in one fixed order whatever M is: one program
owns a (BLOCK_M, BLOCK_N) tile and walks K from 0 in BLOCK_K steps, accumulating each step's
tl.dot into a float32 tile; no split-K, no autotune. The config depends only on the weight's
shape and dtype (matmul_config), never on M, and M is not specialised on (`do_not_specialize`),
so one compiled kernel serves every row count and row i of the result is the same bits whether
the call has 1 row or 4096.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._backend import HAS_TRITON, dot_dtype, interpreting, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    from ._backend import grouped_tile


def matmul_ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: F.linear accumulated in float32 (float64 for a float64 oracle)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    y = F.linear(x.to(acc), w.to(acc), None if b is None else b.to(acc))
    return y.to(x.dtype)


if HAS_TRITON:
    @triton.jit(do_not_specialize=["M"])
    def _matmul_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_DTYPE: tl.constexpr):
        pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm           # (BM, 1)
        w_cols = w_ptr + rn.to(tl.int64)[None, :] * stride_wn           # (1, BN): w[n, :] is column n
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):                                 # the one K order of every output
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            a = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(DOT_DTYPE)
            b = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0).to(DOT_DTYPE)
            if DOT_DTYPE == tl.float32:          # float32 stays float32 (no TF32), as torch's default
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            acc = acc + tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


def matmul_config(n: int, k: int, dtype: torch.dtype) -> dict:
    """Tile sizes and launch options for a (n, k) weight: a function of the weight's shape and
    dtype, never of the row count (that is the whole point)."""
    if interpreting():                       # few programs, few loop trips: the interpreter pays per op
        return dict(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1)
    if dtype == torch.float32:               # exact float32: CUDA-core FMAs, no tensor cores
        return dict(block_m=32, block_n=64, block_k=32, num_warps=4, num_stages=3)
    # 16-bit: one warpgroup on a 64-row tile (Hopper's wgmma); 64-wide N tiles so a decode step's
    # projections still spread over the SMs (N = 4096 -> 64 programs); one 64-wide K step
    return dict(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=4)


def matmul_triton(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, *,
                  block_m: int, block_n: int, block_k: int, num_warps: int = 4, num_stages: int = 3,
                  group_m: int = 8, out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch parameters are arguments so benchmarks/kernel_sweep.py can compare them; the
    model always passes matmul_config's. `out` (M, N) contiguous, if given, receives the result."""
    K = x.shape[-1]
    N = w.shape[0]
    assert w.shape[1] == K and w.stride(1) == 1, "w must be (N, K) with unit stride along K"
    assert x.dtype == w.dtype, f"x is {x.dtype} but w is {w.dtype}"
    assert min(block_m, block_n, block_k) >= 16          # tl.dot needs tiles >= 16 on NVIDIA
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    assert out.shape == (M, N) and out.stride(1) == 1 and out.dtype == x.dtype
    if M > 0:
        grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
        _matmul_kernel[grid](
            x2, w, w if b is None else b, out, M, N, K, x2.stride(0), w.stride(0), out.stride(0),
            HAS_BIAS=b is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
            DOT_DTYPE=dot_dtype(x), num_warps=num_warps, num_stages=num_stages)
    return out.view(*x.shape[:-1], N)


def deterministic_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                         backend: str = "auto") -> torch.Tensor:
    """F.linear with a row count-independent reduction order: the Triton kernel on CUDA tensors
    (or where backend="triton" asks for it), the reference elsewhere (which is NOT batch-invariant
    on CPU: the compiled CPU forward has its own deterministic path)."""
    if use_triton(x, backend):
        return matmul_triton(x, w, b, **matmul_config(w.shape[0], w.shape[1], w.dtype))
    return matmul_ref(x, w, b)
