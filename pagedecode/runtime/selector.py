"""TokenSelector: one step's logits for the requests that choose a token -> their tokens.

Owns the per-slot sampler state (penalties and bias, made on first use) and builds the
per-row inputs of the sampler; the min_tokens mask is applied here as one indexed write."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ..kernels.penalties import PenaltyInputs, PenaltyState, apply_penalties_ref, make_penalty_inputs
from ..kernels.philox import seed_to_int64
from ..kernels.sampling import make_sampling_inputs, sample, unpack_bitmask
from ..params import SamplingParams
from .events import TopLogprobs
from .request import Request



@dataclass
class Selection:
    tokens: list[int]                    # one per row
    logprobs: list[float] | None         # None when no row needed them (greedy, no logprobs)
    bad: frozenset[int]                  # rows whose logits were not usable (NaN / inf, or all -inf)
    top: list[TopLogprobs] | None = None  # per row, its N most likely (id, logprob); None: nobody asked
    empty: frozenset[int] = frozenset()  # rows left with no allowed token (bias, min_tokens, grammar)
    # prompt_logprobs: seq index -> (first prompt token scored, its logprobs, their top N or None)
    prompt: dict[int, tuple[int, list[float], list[TopLogprobs] | None]] | None = None


def prompt_logprobs(logits: torch.Tensor, spans: Sequence[tuple[int, int, int]], reqs: Sequence[Request]
                    ) -> dict[int, tuple[int, list[float], list[TopLogprobs] | None]]:
    """logits (P, V): the model's rows for the prompt positions in `spans` ((seq, first token
    scored, count), in row order; reqs[seq] owns it). Each prompt token's logprob is the float32
    log-softmax of the model's raw logits at the position before it (no penalties, bias or
    temperature: what the model assigns), with the N most likely tokens when N > 0."""
    lsm = torch.log_softmax(logits.float(), dim=-1)
    out: dict[int, tuple[int, list[float], list[TopLogprobs] | None]] = {}
    row = 0
    for seq, first, count in spans:
        req = reqs[seq]
        part = lsm[row:row + count]
        row += count
        targets = torch.tensor(req.prompt_ids[first:first + count], device=part.device)
        own = part.gather(1, targets[:, None])[:, 0].tolist()
        n = req.params.prompt_logprobs or 0
        tops: list[TopLogprobs] | None = None
        if n:
            values, ids = part.topk(min(n, part.shape[-1]), dim=-1)
            tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
        out[seq] = (first, own, tops)
    return out


def uses_penalties(p: SamplingParams) -> bool:
    return bool(p.logit_bias) or p.repetition_penalty != 1.0 or p.presence_penalty != 0 or p.frequency_penalty != 0


class TokenSelector:
    def __init__(self, eos_ids: frozenset[int], num_slots: int, vocab_size: int, device: torch.device,
                 backend: str) -> None:
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
            self._penalty_state().reset(self._slot(req), req.prompt_ids, req.output_ids, req.params.logit_bias)

    def select(self, logits: torch.Tensor, reqs: Sequence[Request], bitmask: torch.Tensor | None = None
               ) -> Selection:
        """logits (N, V), one row per request; bitmask (N, ceil(V / 32)) int32: the tokens each row's
        grammar allows (all bits set for unconstrained rows), applied after penalties. A row whose
        logits hold NaN or +inf, or nothing above -inf, chooses no token: it is reported in `bad`.
        A row that logit_bias, the min_tokens mask and the grammar together leave with no token
        above -inf chooses none either: it is reported in `empty` (the sampler marks it with a
        NaN logprob, on both paths)."""
        masked = self._mask_min_tokens(logits, reqs)
        active = [uses_penalties(r.params) for r in reqs]
        want_logprobs = any(r.params.logprobs is not None for r in reqs)
        if bitmask is None and not any(active) and not want_logprobs and all(r.params.greedy for r in reqs):
            best, argmax = masked.max(dim=-1)       # max propagates NaN
            unusable = self._bad_rows(best)
            bad = self._bad_rows(logits.amax(dim=-1)) if unusable else frozenset()
            return Selection(argmax.tolist(), None, bad, empty=unusable - bad)
        dev = logits.device
        p = [r.params for r in reqs]
        vocab = logits.shape[-1]
        inputs = make_sampling_inputs([q.temperature for q in p], [q.top_k if q.top_k < vocab else 0 for q in p],
                                      [q.top_p for q in p], [q.min_p for q in p],
                                      [seed_to_int64(r.seed) for r in reqs], [len(r.output_ids) for r in reqs],
                                      device=dev)
        penalties = None
        if any(active):
            penalties = make_penalty_inputs(self._penalty_state(), [self._slot(r) for r in reqs],
                                            [q.repetition_penalty for q in p], [q.presence_penalty for q in p],
                                            [q.frequency_penalty for q in p], active, dev)
        bad = self._bad_rows(logits.amax(dim=-1))      # the model's own logits, before any mask
        rows = masked.float().contiguous()
        allowed = None
        if bitmask is not None:            # unpacked once, for top logprobs
            bitmask = bitmask.to(dev, non_blocking=True)
            if any(r.params.logprobs for r in reqs):
                allowed = unpack_bitmask(bitmask, vocab)
        out = sample(rows, inputs, backend=self.backend, penalties=penalties, bitmask=bitmask)
        tokens, logprobs = out.tokens.tolist(), out.logprobs.tolist()
        empty = frozenset(i for i, lp in enumerate(logprobs) if not math.isfinite(lp)) - bad
        top = self._top_logprobs(rows, penalties, reqs, allowed)
        if penalties is not None:
            chosen = [(self._slot(r), t) for i, (r, t, a) in enumerate(zip(reqs, tokens, active))
                      if a and i not in bad and i not in empty]
            self._penalty_state().record([s for s, _ in chosen], [t for _, t in chosen])
        return Selection(tokens, logprobs, bad, top, empty)

    @staticmethod
    def _top_logprobs(rows: torch.Tensor, penalties: PenaltyInputs | None, reqs: Sequence[Request],
                      allowed: torch.Tensor | None = None) -> list[TopLogprobs] | None:
        """The N most likely tokens of each row that asks for N > 0, from the same logits the
        chosen token's logprob comes from (after penalties and bias, before temperature)."""
        wanted = [r.params.logprobs or 0 for r in reqs]
        n = max(wanted, default=0)
        if n == 0:
            return None
        x = apply_penalties_ref(rows, penalties) if penalties is not None else rows
        if allowed is not None:
            x = x.masked_fill(~allowed, float("-inf"))
        values, ids = torch.log_softmax(x, dim=-1).topk(min(n, x.shape[-1]), dim=-1)
        vals, idx = values.tolist(), ids.tolist()
        return [tuple(zip(idx[i][:k], vals[i][:k])) for i, k in enumerate(wanted)]

    @staticmethod
    def _slot(req: Request) -> int:
        if req.slot is None:
            raise RuntimeError(f"request {req.request_id} selects a token without a batch slot")
        return req.slot

    @staticmethod
    def _bad_rows(row_max: torch.Tensor) -> frozenset[int]:
        """Rows whose maximum is not finite: NaN anywhere, +inf, or every logit -inf."""
        ok = torch.isfinite(row_max)
        if bool(ok.all()):
            return frozenset()
        return frozenset(int(i) for i in torch.nonzero(~ok).flatten().tolist())

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
