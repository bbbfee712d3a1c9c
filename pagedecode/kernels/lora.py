"""LoRA for a batch that mixes adapters: the low-rank delta of one projection, rows grouped by
adapter as Punica's SGMV groups them (shrink x -> x A^T, then expand -> (x A^T) B^T, scaled).

The adapters resident on the engine are stacked per projection: A (S, R, K) and B (S, N, R) for S
adapter slots, R = max_lora_rank; an adapter of smaller rank r fills A[s, :r] and B[s, :, :r] and
leaves the rest zero, so one stack serves every rank. The caller orders the batch's rows so each
adapter's rows are contiguous (a segment) and passes the segments:

    seg_starts  int32 (G + 1,)  segment g is rows seg_starts[g] : seg_starts[g + 1]
    seg_slots   int32 (G,)      its adapter slot, or -1 for rows without an adapter (delta 0)

The segments cover the rows: seg_starts[0] = 0, non-decreasing, seg_starts[G] = M (a segment may
be empty).

`lora_delta_reference` is the definition every implementation is held to; `lora_delta` picks the
implementation by device and backend as the other kernels do (_backend.use_triton).

The Triton path is two kernels, each one program per (segment, row tile, ...), the grid sized
from M and G alone (no host sync, so a CUDA graph can hold it): a row tile past its segment's
end returns at once.

  shrink  (G, M / BLOCK_M, splits): shrunk[split, rows, :R] = x[rows, its K range] @ A[s, :, K range]^T
          in float32. K is cut into `splits` fixed ranges (k_per_split inputs, a function of K only)
          so a decode step with few rows still has programs enough to read A at bandwidth.
  expand  (G, M / BLOCK_M, N / BLOCK_N): out[rows, n tile] = scaling[s] * (sum over splits, in
          split order, of shrunk) @ B[s, n tile, :R]^T, in float32 (B widened: R <= 64 keeps this
          small beside the base matmul), stored in x's dtype; zeros for slot -1.

Every row's sum over K has one order whatever the batch holds (the K tiles and splits depend on K
only), so a row's delta does not change with the rows beside it.
"""
from __future__ import annotations

import torch

from ._backend import HAS_TRITON, dot_dtype, interpreting, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl


def lora_delta_reference(x: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor,
                         a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor) -> torch.Tensor:
    """x (M, K); a (S, R, K); b (S, N, R); scaling float32 (S,) -> delta (M, N) in x's dtype,
    computed in float32: delta[rows of g] = scaling[s] * (x[rows] @ a[s].T) @ b[s].T."""
    M, N = x.shape[0], b.shape[1]
    out = torch.zeros(M, N, dtype=torch.float32, device=x.device)
    starts = seg_starts.tolist()
    for g, slot in enumerate(seg_slots.tolist()):
        lo, hi = starts[g], starts[g + 1]
        if slot < 0 or hi == lo:
            continue
        shrunk = x[lo:hi].float() @ a[slot].float().T                  # (rows, R)
        out[lo:hi] = (shrunk @ b[slot].float().T) * scaling[slot].float()
    return out.to(x.dtype)


if HAS_TRITON:
    @triton.jit
    def _shrink_kernel(x_ptr, a_ptr, seg_starts_ptr, seg_slots_ptr, shrunk_ptr, K, R, k_per_split,
                       stride_xm, stride_as, stride_ar, stride_sk, stride_sm,
                       BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                       DOT_DTYPE: tl.constexpr):
        """shrunk[split, rows, :R] for one (segment, row tile, K split); k_per_split a multiple of BLOCK_K."""
        g = tl.program_id(0)
        split = tl.program_id(2)
        slot = tl.load(seg_slots_ptr + g)
        hi = tl.load(seg_starts_ptr + g + 1)
        row0 = tl.load(seg_starts_ptr + g) + tl.program_id(1) * BLOCK_M
        if (slot < 0) | (row0 >= hi):          # no adapter (expand writes zeros), or past the segment
            return
        rm = row0 + tl.arange(0, BLOCK_M)
        m_ok = rm < hi
        rr = tl.arange(0, BLOCK_R)
        r_ok = rr < R
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm                              # (BM, 1)
        a_cols = a_ptr + slot.to(tl.int64) * stride_as + rr.to(tl.int64)[None, :] * stride_ar   # (1, BR)
        acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
        k_lo = split * k_per_split
        for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            xt = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(DOT_DTYPE)
            at = tl.load(a_cols + k[:, None], mask=k_ok[:, None] & r_ok[None, :],
                         other=0.0).to(DOT_DTYPE)                                      # (BK, BR): A^T
            if DOT_DTYPE == tl.float32:        # float32 stays float32 (no TF32), as the reference
                acc = tl.dot(xt, at, acc, input_precision="ieee")
            else:                              # 16-bit products are exact in the float32 accumulator
                acc = tl.dot(xt, at, acc)
        tl.store(shrunk_ptr + split * stride_sk + rm.to(tl.int64)[:, None] * stride_sm + rr[None, :], acc,
                 mask=m_ok[:, None] & r_ok[None, :])

    @triton.jit
    def _expand_kernel(shrunk_ptr, b_ptr, scaling_ptr, seg_starts_ptr, seg_slots_ptr, out_ptr, N, R, splits,
                       stride_sk, stride_sm, stride_bs, stride_bn, stride_om,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
        """out[rows, n tile] for one (segment, row tile, n tile): the delta, or zeros for slot -1."""
        g = tl.program_id(0)
        slot = tl.load(seg_slots_ptr + g)
        hi = tl.load(seg_starts_ptr + g + 1)
        row0 = tl.load(seg_starts_ptr + g) + tl.program_id(1) * BLOCK_M
        if row0 >= hi:
            return
        rm = row0 + tl.arange(0, BLOCK_M)
        m_ok = rm < hi
        rn = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        delta = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if slot >= 0:
            rr = tl.arange(0, BLOCK_R)
            r_ok = rr < R
            s_ptrs = shrunk_ptr + rm.to(tl.int64)[:, None] * stride_sm + rr[None, :]       # (BM, BR)
            s_ok = m_ok[:, None] & r_ok[None, :]
            shrunk = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
            for split in range(0, splits):     # the K splits' partial sums, always in split order
                shrunk += tl.load(s_ptrs + split * stride_sk, mask=s_ok, other=0.0)
            bt = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + rn.to(tl.int64)[None, :] * stride_bn + rr[:, None],
                         mask=r_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)      # (BR, BN): B^T
            delta = tl.dot(shrunk, bt, delta, input_precision="ieee") * tl.load(scaling_ptr + slot).to(tl.float32)
        tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :], delta.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


def lora_config(M: int, K: int) -> dict:
    """Tiles and the K split: BLOCK_K and k_per_split depend on K only (a row's order of sums is
    the batch's business nowhere); BLOCK_M follows M (it only decides which rows share a tile)."""
    if interpreting():                         # few programs, few loop trips: the interpreter pays per op
        return dict(block_m=16, block_n=128, block_k=64, k_per_split=max(64, -(-K // 64) * 64))
    # at most 4 splits of at least 512 inputs: an 8B model's K = 4096 gives 4, enough programs for
    # a decode step's A reads, few enough that each expand program re-reads little of the partials
    k_per_split = max(512, -(-K // (4 * 64)) * 64)
    return dict(block_m=16 if M <= 64 else 64, block_n=64, block_k=64, k_per_split=k_per_split)


def _check(x: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor, a: torch.Tensor,
           b: torch.Tensor, scaling: torch.Tensor) -> None:
    """Shapes always; the segments' values only where they are on the host (on CUDA, reading them
    would stall the stream)."""
    if x.dim() != 2 or a.dim() != 3 or b.dim() != 3 or a.shape[2] != x.shape[1] or b.shape[2] != a.shape[1] or \
            b.shape[0] != a.shape[0] or tuple(scaling.shape) != (a.shape[0],) or \
            seg_starts.dim() != 1 or tuple(seg_slots.shape) != (seg_starts.shape[0] - 1,):
        raise ValueError(f"lora shapes do not fit: x {tuple(x.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}, "
                         f"scaling {tuple(scaling.shape)}, seg_starts {tuple(seg_starts.shape)}, "
                         f"seg_slots {tuple(seg_slots.shape)}")
    if seg_starts.is_cuda or seg_slots.is_cuda:
        return
    starts, slots = seg_starts.tolist(), seg_slots.tolist()
    if starts[0] != 0 or starts[-1] != x.shape[0] or any(lo > hi for lo, hi in zip(starts, starts[1:])):
        raise ValueError(f"segments {starts} do not cover the {x.shape[0]} rows in order")
    if any(s >= a.shape[0] or s < -1 for s in slots):
        raise ValueError(f"adapter slots {slots} outside -1 .. {a.shape[0] - 1}")


def lora_delta_triton(x: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor, a: torch.Tensor,
                      b: torch.Tensor, scaling: torch.Tensor, out: torch.Tensor | None = None, *,
                      block_m: int, block_n: int, block_k: int, k_per_split: int, num_warps: int = 4) -> torch.Tensor:
    """The two kernels (module docstring); `out` (M, N) in x's dtype, if given, receives every
    element (tests poison it with NaN). Launch parameters are arguments for tests and sweeps."""
    _check(x, seg_starts, seg_slots, a, b, scaling)
    assert min(block_m, block_n, block_k) >= 16 and k_per_split % block_k == 0     # tl.dot: tiles >= 16
    x, a, b = x.contiguous(), a.contiguous(), b.contiguous()
    M, K = x.shape
    S, R, N = a.shape[0], a.shape[1], b.shape[1]
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    assert out.shape == (M, N) and out.stride(1) == 1 and out.dtype == x.dtype
    G = seg_slots.shape[0]
    if M == 0 or N == 0 or G == 0:
        return out
    splits = max(1, -(-K // k_per_split))
    block_r = max(16, triton.next_power_of_2(R))
    shrunk = torch.empty((splits, M, R), dtype=torch.float32, device=x.device)    # (splits, M, R) partials
    # the segments may be built on the host: the kernels read them on x's device
    seg_starts = seg_starts.to(device=x.device, dtype=torch.int32)
    seg_slots = seg_slots.to(device=x.device, dtype=torch.int32)
    scaling = scaling.to(device=x.device, dtype=torch.float32)
    row_tiles = triton.cdiv(M, block_m)
    # a's dot type: x's when A shares it (16-bit products exact in float32), float32 otherwise
    dot = dot_dtype(x) if a.dtype == x.dtype else tl.float32
    _shrink_kernel[(G, row_tiles, splits)](
        x, a, seg_starts, seg_slots, shrunk, K, R, k_per_split, x.stride(0), a.stride(0), a.stride(1),
        shrunk.stride(0), shrunk.stride(1), BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, DOT_DTYPE=dot,
        num_warps=num_warps)
    _expand_kernel[(G, row_tiles, triton.cdiv(N, block_n))](
        shrunk, b, scaling, seg_starts, seg_slots, out, N, R, splits, shrunk.stride(0), shrunk.stride(1),
        b.stride(0), b.stride(1), out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
        num_warps=num_warps)
    return out


def lora_delta(x: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor, a: torch.Tensor,
               b: torch.Tensor, scaling: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """The delta of lora_delta_reference: by the Triton segmented kernels on CUDA tensors (or where
    `backend` asks for them), by the reference elsewhere (backend as in kernels/_backend.py)."""
    if use_triton(x, backend):
        return lora_delta_triton(x, seg_starts, seg_slots, a, b, scaling, **lora_config(x.shape[0], x.shape[1]))
    _check(x, seg_starts, seg_slots, a, b, scaling)
    return lora_delta_reference(x, seg_starts, seg_slots, a, b, scaling)
