"""TokenSelector: one step's logits for the requests that choose a token -> their tokens.

Owns the per-slot sampler state (penalties and bias, made on first use) and builds the
per-row inputs of the sampler; the min_tokens mask is applied here as one indexed write."""
from __future__ import annotations

from typing import Sequence

import torch

from ..kernels.penalties import PenaltyState, make_penalty_inputs
from ..kernels.philox import seed_to_int64
from ..kernels.sampling import make_sampling_inputs, sample
from ..params import SamplingParams
from .request import Request


def uses_penalties(p: SamplingParams) -> bool:
    return bool(p.logit_bias) or p.repetition_penalty != 1.0 or p.presence_penalty != 0 or p.frequency_penalty != 0


class TokenSelector:
    def __init__(self, eos_ids: frozenset[int], num_slots: int, vocab_size: int, device, backend: str) -> None:
        self.eos_ids = eos_ids
        self.num_slots = num_slots
        self.vocab_size = vocab_size
        self.device = device
        self.backend = backend
        self._state: PenaltyState | None = None

    def _penalty_state(self) -> PenaltyState:
        if self._state is None:
            self._state = PenaltyState(self.num_slots, self.vocab_size, self.device)
        return self._state

    def admit(self, req: Request) -> None:
        """A request took a slot (first time or after preemption): its state moves in."""
        if uses_penalties(req.params):
            assert req.slot is not None, "admitted requests hold a slot"
            self._penalty_state().reset(req.slot, req.prompt_ids, req.output_ids, req.params.logit_bias)

    def select(self, logits: torch.Tensor, reqs: Sequence[Request]) -> tuple[list[int], list]:
        """logits (N, V), one row per request; returns the tokens and their logprobs (None when
        no request asked for logprobs and all are greedy)."""
        logits = self._mask_min_tokens(logits, reqs)
        active = [uses_penalties(r.params) for r in reqs]
        if not any(active) and all(r.params.greedy and r.params.logprobs is None for r in reqs):
            return logits.argmax(dim=-1).tolist(), [None] * len(reqs)
        dev = logits.device
        p = [r.params for r in reqs]
        inputs = make_sampling_inputs([q.temperature for q in p], [q.top_k for q in p], [q.top_p for q in p],
                                      [q.min_p for q in p], [seed_to_int64(r.seed) for r in reqs],
                                      [len(r.output_ids) for r in reqs], device=dev)
        penalties = None
        if any(active):
            penalties = make_penalty_inputs(self._penalty_state(), [r.slot or 0 for r in reqs],
                                            [q.repetition_penalty for q in p], [q.presence_penalty for q in p],
                                            [q.frequency_penalty for q in p], active, dev)
        out = sample(logits.float().contiguous(), inputs, backend=self.backend, penalties=penalties)
        tokens = out.tokens.tolist()
        if penalties is not None:
            chosen = [(r.slot or 0, t) for r, t, a in zip(reqs, tokens, active) if a]
            self._penalty_state().record([s for s, _ in chosen], [t for _, t in chosen])
        return tokens, out.logprobs.tolist()

    def _mask_min_tokens(self, logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        """EOS and single stop ids get -inf until a request has min_tokens tokens."""
        rows, ids = [], []
        for row, req in enumerate(reqs):
            p = req.params
            if len(req.output_ids) < p.min_tokens:
                banned = ([] if p.ignore_eos else list(self.eos_ids)) + [q[0] for q in p.stop_id_seqs if len(q) == 1]
                rows += [row] * len(banned)
                ids += banned
        if not rows:
            return logits
        logits = logits.clone()
        logits[torch.tensor(rows), torch.tensor(ids)] = float("-inf")
        return logits
