"""ForwardBatch: what one model step computes, as plain tensors plus a little host metadata.

Layout of the packed token rows (T rows in all):
    [ decode seq 0 | decode seq 1 | ... | prefill seq a (n_a rows) | prefill seq b | ... ]
The first `num_decode` sequences add exactly one token each; the rest add a chunk of their
prompt (or a recompute after preemption), or, last, verify speculative drafts: the last known
token then k draft tokens, k + 1 rows whose logits choose k + 1 tokens. Sequence s owns rows cu_q[s] : cu_q[s + 1].

Positions, for a sequence with `cached` tokens already in its pages and n new ones:
    new token i sits at logical position cached + i, in slot
    page_table[s, (cached + i) // page_size] * page_size + (cached + i) % page_size,
and seq_lens[s] = cached + n (its K/V are written before attention reads them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..lora.stacks import LoRABatch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor        # (T,) int64
    positions: torch.Tensor        # (T,) int64
    slot_mapping: torch.Tensor     # (T,) int64
    page_table: torch.Tensor       # (S, max_pages) int32
    seq_lens: torch.Tensor         # (S,) int32, after this step's writes
    cu_q: torch.Tensor             # (S + 1,) int32
    logits_indices: torch.Tensor   # (N + P + D,) int64: rows whose logits are wanted: the row after the
                                   # last known token of each sampling seq, then P rows whose logits
                                   # score prompt tokens, then the D rows after each draft token
    num_decode: int                # leading sequences with exactly one new token
    max_new: int                   # most new tokens of any sequence
    max_seq_len: int | None = None # a host bound on seq_lens (a captured decode graph's: model/cuda_graphs.py),
                                   # so decode attention sizes its splits without reading seq_lens back;
                                   # None: it reads the batch's own longest length
    lora: "LoRABatch | None" = None # LoRA: the resident adapters and which rows run under which (lora/stacks.py);
                                   # None: no row of this batch has an adapter
    # for the token selector, not the model (sent in the same copy as the rows above): per
    # sampling row (the N rows of logits_indices), its batch slot and output position, int64
    sample_slots: torch.Tensor | None = None
    sample_index: torch.Tensor | None = None
    # host-side facts for test doubles and tracing; references, never copied per step
    request_ids: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)   # each seq's prompt ids
    output_ids: list[list[int]] = field(default_factory=list)  # each seq's selected ids so far
    logits_seqs: list[int] = field(default_factory=list)       # which seqs own logits_indices[:N]
    # prompt_logprobs: (seq, first prompt token scored, count) for logits_indices[N:], in order
    prompt_spans: list[tuple[int, int, int]] = field(default_factory=list)
    # speculation: each seq's draft tokens (its last rows; empty for most seqs), in seq order
    drafts: list[tuple[int, ...]] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
