"""The resident adapters' weights as the forward reads them: per layer and projection, A stacked
(S, R, K) and B stacked (S, N, R) over the S = max_loras slots, zero padded to R = max_lora_rank
(kernels/lora.py's layout; on the host B is a view of a contiguous B^T (S, R, N), the compiled
forward's), and each slot's scaling (S,) float32. A slot is written when an
adapter takes it and zeroed when another replaces it; the buffers never move, so the compiled
CPU forward's view of them (compiled_view) is made once per set of targeted projections.

LoRABatch is what one forward needs besides: the stacks and the batch's segments, runs of rows
under one slot (model/batch.py keeps decode rows first, so rows are grouped by adapter within
that order, not sorted across it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..model.config import ModelConfig
from .adapter import PROJECTIONS, LoRAAdapter, projection_shapes


def stack_dtype(model: Any) -> torch.dtype:
    """The stacks' dtype: the model's, except bfloat16 over quantized layer weights with float32
    activations (model.quantized). Each decode step reads every resident adapter's A and B in
    full: at rank 16 on all seven projections, in float32, that was ~30 % of the bytes a Q4_1
    SmolLM2 step reads and the adapters' whole cost (benchmarks/lora.py); bfloat16 halves it, and
    its rounding (2^-9 of each weight) is far inside the base weights' own 4-bit error. A float
    base keeps its dtype, so its adapters stay exact against peft."""
    if getattr(model, "quantized", False) and model.dtype == torch.float32:
        return torch.bfloat16
    return model.dtype


class LoRAStacks:
    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        shapes = projection_shapes(config)
        S, R = max_loras, max_rank
        self.a = [{p: torch.zeros(S, R, shapes[p][1], dtype=dtype, device=device) for p in PROJECTIONS}
                  for _ in range(config.num_layers)]                              # (S, R, K)
        # B (S, N, R); on the host a view of B^T (S, R, N) stored contiguous: the compiled forward's
        # expand reads each rank's row of N along the output's columns (csrc/lora_delta.h)
        host = torch.device(device).type == "cpu"
        self.b = [{p: (torch.zeros(S, R, shapes[p][0], dtype=dtype, device=device).transpose(1, 2) if host else
                       torch.zeros(S, shapes[p][0], R, dtype=dtype, device=device)) for p in PROJECTIONS}
                  for _ in range(config.num_layers)]
        self.scaling = [{p: torch.zeros(S, dtype=torch.float32, device=device) for p in PROJECTIONS}
                        for _ in range(config.num_layers)]
        self.targets: list[frozenset[str]] = [frozenset()] * S     # each slot's adapter's projections
        self.ranks = torch.zeros(S, dtype=torch.int32)      # each slot's adapter's rank (host: the compiled
                                                            # forward reads only A[s, :r], B[s, :, :r])
        # the projections some resident adapter targets: the forward skips the others
        self.active: frozenset[str] = frozenset()
        self._compiled: tuple[frozenset[str], Any] | None = None

    def write(self, slot: int, adapter: LoRAAdapter) -> None:
        """Slot `slot` holds `adapter` (every projection it lacks, and the rank padding, zero)."""
        self.clear(slot)
        for (layer, proj), w in adapter.weights.items():
            r = w.a.shape[0]
            self.a[layer][proj][slot, :r].copy_(w.a)
            self.b[layer][proj][slot, :, :r].copy_(w.b)
            self.scaling[layer][proj][slot] = w.scaling
        self.targets[slot] = adapter.projections
        self.ranks[slot] = adapter.rank
        self.active = frozenset().union(*self.targets)

    def clear(self, slot: int) -> None:
        for layer in range(len(self.a)):
            for proj in self.targets[slot]:
                self.a[layer][proj][slot].zero_()
                self.b[layer][proj][slot].zero_()
                self.scaling[layer][proj][slot] = 0.0
        self.targets[slot] = frozenset()
        self.ranks[slot] = 0
        self.active = frozenset().union(*self.targets)

    def compiled_view(self, make: Callable[[list[list[torch.Tensor]], torch.Tensor], Any]) -> Any:
        """The compiled forward's LoraStack (made by `make` from each layer's [A, B^T, scaling] per
        projection in PROJECTIONS' order, empty tensors for projections no resident adapter
        targets, and the slots' ranks), remade only when that set changes."""
        active = self.active
        if self._compiled is None or self._compiled[0] != active:
            none = torch.empty(0)
            layers = [[t for p in PROJECTIONS
                       for t in ((a[p], b[p].transpose(1, 2), s[p]) if p in active else (none, none, none))]
                      for a, b, s in zip(self.a, self.b, self.scaling)]
            self._compiled = (active, make(layers, self.ranks))
        return self._compiled[1]


def segments(seq_slots: Sequence[int], seq_rows: Sequence[int]) -> tuple[list[int], list[int]]:
    """Runs of consecutive sequences under one adapter slot (-1: none) as kernels/lora.py's
    segments: (starts (G + 1,), slots (G,)) over the rows, sequence i owning seq_rows[i] rows."""
    starts: list[int] = [0]
    slots: list[int] = []
    for slot, rows in zip(seq_slots, seq_rows):
        if slots and slots[-1] == slot:
            starts[-1] += rows
        else:
            slots.append(slot)
            starts.append(starts[-1] + rows)
    return starts, slots


@dataclass
class LoRABatch:
    stacks: LoRAStacks
    seg_starts: torch.Tensor      # (G + 1,) int32
    seg_slots: torch.Tensor       # (G,) int32, -1: rows without an adapter
