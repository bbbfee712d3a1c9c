"""Penalties and logit bias, from per-slot sampler state kept on the logits' device.

PenaltyState holds, for each batch slot, dense rows over the vocabulary:
    counts (slots, V) int32    how often each token was selected (output only)
    seen   (slots, V) uint8    1 for tokens in the prompt or the output
    bias   (slots, V) float32  the request's logit bias
and its settings, (slots,) each: repetition, presence, frequency (float32), active (int32).
A slot is reset and configured when a request takes it (admission, or re-admission after
preemption) and updated once per selected token, so no step ever walks a request's token
history, and a step's penalties need nothing from the host but which slot each row reads.

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
        # each slot's settings, written when a request takes it (`configure`); active == 0: the
        # slot's rows are left as they are
        self.repetition = torch.ones(num_slots, dtype=torch.float32, device=device)
        self.presence = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.frequency = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.active = torch.zeros(num_slots, dtype=torch.int32, device=device)

    def configure(self, slot: int, repetition: float, presence: float, frequency: float, active: bool) -> None:
        """The slot's settings (fills on the device: no copy from the host)."""
        self.repetition[slot].fill_(repetition)
        self.presence[slot].fill_(presence)
        self.frequency[slot].fill_(frequency)
        self.active[slot].fill_(int(active))

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

    def record_rows(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """The same from device tensors, one token per row (B,): rows whose slot is not active
        add nothing, so no host list is built and nothing is copied to the device."""
        s, t = slots.long(), tokens.long().clamp(0, self.vocab_size - 1)
        active = self.active[s]                                          # (B,) int32
        self.counts.index_put_((s, t), active, accumulate=True)
        self.seen.index_put_((s, t), self.seen[s, t] | active.to(torch.uint8))


@dataclass
class PenaltyInputs:
    """Per row of the logits (B,): which slot's state (counts, seen, bias and settings) to use.
    Rows whose slot is not active are left as they are."""
    state: PenaltyState
    slot: torch.Tensor          # (B,) int32 or int64

    # each row's settings, read through its slot (the reference and tests use them)
    @property
    def repetition(self) -> torch.Tensor:
        return self.state.repetition[self.slot.long()]

    @property
    def presence(self) -> torch.Tensor:
        return self.state.presence[self.slot.long()]

    @property
    def frequency(self) -> torch.Tensor:
        return self.state.frequency[self.slot.long()]

    @property
    def active(self) -> torch.Tensor:
        return self.state.active[self.slot.long()]


def make_penalty_inputs(state, slots, repetition, presence, frequency, active, device) -> PenaltyInputs:
    """From per-row lists (rows name distinct slots): writes each row's settings to its slot."""
    assert len(set(slots)) == len(slots), "each row names its own slot"
    for s, r, p, f, a in zip(slots, repetition, presence, frequency, active):
        state.configure(s, r, p, f, bool(a))
    return PenaltyInputs(state, torch.tensor(slots, dtype=torch.int32, device=device))


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
