"""Logit processors applied before selection, in place, in torch (both paths): logit bias, the
min_tokens mask, repetition (HF rule), presence and frequency (OpenAI rule) penalties."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class RowProcessing:
    row: int
    logit_bias: dict[int, float] | None
    banned: Sequence[int]               # ids masked to -inf (EOS / stop ids inside min_tokens)
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]


def apply_processing(logits: torch.Tensor, rows: Sequence[RowProcessing]) -> torch.Tensor:
    """logits (B, V) float32, changed in place for the listed rows only."""
    V = logits.shape[1]
    dev = logits.device
    for r in rows:
        x = logits[r.row]
        if r.logit_bias:
            ids = torch.tensor([i for i in r.logit_bias if i < V], dtype=torch.long, device=dev)
            vals = torch.tensor([b for i, b in r.logit_bias.items() if i < V], dtype=x.dtype, device=dev)
            x.index_add_(0, ids, vals)
        if r.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.prompt_ids) | set(r.output_ids)), dtype=torch.long, device=dev)
            seen = seen[seen < V]
            vals = x[seen]
            x[seen] = torch.where(vals > 0, vals / r.repetition_penalty, vals * r.repetition_penalty)
        if (r.presence_penalty or r.frequency_penalty) and r.output_ids:
            out = torch.tensor(r.output_ids, dtype=torch.long, device=dev)
            counts = torch.bincount(out[out < V], minlength=V).to(x.dtype)
            x -= r.frequency_penalty * counts + r.presence_penalty * (counts > 0).to(x.dtype)
        if r.banned:
            x[torch.tensor([i for i in r.banned if i < V], dtype=torch.long, device=dev)] = float("-inf")
    return logits
