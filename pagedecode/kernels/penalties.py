"""Penalties and logit bias, from per-slot sampler state kept on the logits' device.

PenaltyState holds, for each batch slot, dense rows over the vocabulary:
    counts (slots, V) int32    how often each token was selected (output only)
    seen   (slots, V) uint8    1 for tokens in the prompt or the output
    bias   (slots, V) float32  the request's logit bias
A row is reset when a request takes the slot (admission, or re-admission after preemption)
and updated once per selected token, so no step ever walks a request's token history.

Order (both paths): x + bias; then repetition (HF rule: seen tokens' positive logits divided
by the penalty, negative ones multiplied); then frequency * count + presence * (count > 0)
subtracted (OpenAI rule). The Triton sampler applies this in its first pass over the logits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from ._backend import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl


class PenaltyState:
    def __init__(self, num_slots: int, vocab_size: int, device) -> None:
        self.vocab_size = vocab_size
        self.counts = torch.zeros(num_slots, vocab_size, dtype=torch.int32, device=device)
        self.seen = torch.zeros(num_slots, vocab_size, dtype=torch.uint8, device=device)
        self.bias = torch.zeros(num_slots, vocab_size, dtype=torch.float32, device=device)

    def reset(self, slot: int, prompt_ids: Sequence[int], output_ids: Sequence[int],
              logit_bias: Mapping[int, float] | None) -> None:
        dev, V = self.counts.device, self.vocab_size
        self.counts[slot].zero_()
        self.seen[slot].zero_()
        self.bias[slot].zero_()
        seen = torch.tensor([t for t in (*prompt_ids, *output_ids) if 0 <= t < V], dtype=torch.long, device=dev)
        self.seen[slot, seen] = 1
        out = torch.tensor([t for t in output_ids if 0 <= t < V], dtype=torch.long, device=dev)
        if out.numel():
            self.counts[slot].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
        if logit_bias:
            items = [(t, b) for t, b in logit_bias.items() if t < V]
            self.bias[slot, torch.tensor([t for t, _ in items], device=dev)] = torch.tensor(
                [b for _, b in items], dtype=torch.float32, device=dev)

    def record(self, slots: Sequence[int], tokens: Sequence[int]) -> None:
        """One selected token per listed slot."""
        if not slots:
            return
        dev = self.counts.device
        s = torch.tensor(slots, dtype=torch.long, device=dev)
        t = torch.tensor(tokens, dtype=torch.long, device=dev).clamp(0, self.vocab_size - 1)
        self.counts.index_put_((s, t), torch.ones(len(slots), dtype=torch.int32, device=dev), accumulate=True)
        self.seen[s, t] = 1


@dataclass
class PenaltyInputs:
    """Per row of the logits (B,): which slot's state to use and the request's settings. Rows
    with active == 0 are left as they are."""
    state: PenaltyState
    slot: torch.Tensor          # int32
    repetition: torch.Tensor    # float32
    presence: torch.Tensor      # float32
    frequency: torch.Tensor     # float32
    active: torch.Tensor        # int32, 0 or 1


def make_penalty_inputs(state, slots, repetition, presence, frequency, active, device) -> PenaltyInputs:
    return PenaltyInputs(state, torch.tensor(slots, dtype=torch.int32, device=device),
                         torch.tensor(repetition, dtype=torch.float32, device=device),
                         torch.tensor(presence, dtype=torch.float32, device=device),
                         torch.tensor(frequency, dtype=torch.float32, device=device),
                         torch.tensor(active, dtype=torch.int32, device=device))


def apply_penalties_ref(logits: torch.Tensor, p: PenaltyInputs) -> torch.Tensor:
    """logits (B, V) float32 -> a new tensor with the active rows processed (module docstring)."""
    rows = p.active.nonzero().flatten()
    if rows.numel() == 0:
        return logits
    slots = p.slot[rows].long()
    x = logits[rows] + p.state.bias[slots]
    rep = p.repetition[rows][:, None]
    x = torch.where(p.state.seen[slots] != 0, torch.where(x > 0, x / rep, x * rep), x)
    counts = p.state.counts[slots].to(torch.float32)
    x = x - p.frequency[rows][:, None] * counts - p.presence[rows][:, None] * (counts > 0).to(torch.float32)
    out = logits.clone()
    out[rows] = x
    return out


if HAS_TRITON:
    @triton.jit
    def _penalize(x, offs, ok, state, rep, pres, freq, counts_ptr, seen_ptr, bias_ptr):
        # mirrors penalties.apply_penalties_ref: bias, repetition, then frequency and presence
        x = x + tl.load(bias_ptr + state + offs, mask=ok, other=0.0)
        seen = tl.load(seen_ptr + state + offs, mask=ok, other=0) != 0
        x = tl.where(seen, tl.where(x > 0, x / rep, x * rep), x)
        count = tl.load(counts_ptr + state + offs, mask=ok, other=0).to(tl.float32)
        return x - freq * count - pres * (count > 0).to(tl.float32)
