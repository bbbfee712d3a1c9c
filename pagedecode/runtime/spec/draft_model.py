"""The draft-model proposer: a smaller pd.Model with the same tokenizer proposes k tokens on its
own paged KV cache: by greedy decoding, or, for a request under the rejection rule
(rejection.py `takes_rejection`), by sampling each from a distribution q it returns with
the drafts (the target's processing of the draft's logits, on its own Philox stream).

Its pages come from its own pool (a PagePool and KVCache of the draft's shape, with as many
tokens of capacity as the target's cache), not from the engine's: the target's page accounting,
preemption and prefix cache never see them. Per request it keeps its pages and `num_computed`,
the tokens whose draft K/V is valid, always a prefix of the request's known tokens:

    known:          prompt | y1 .. yt                  (n = m + t tokens)
    draft cache:    known[:c] valid                    c <= n - 1
    one proposal:   extend known[c:n] -> d1, then decode d1 -> d2, ..., d_{k-1} -> dk
    afterwards:     c = n, and `ahead` = d1 .. d_{k-1}: their K/V lies at n .. n + k - 2

so the draft is rolled back with the target by construction: the next proposal first takes as
valid the drafts of `ahead` that the target accepted (the same tokens at the same positions:
their K/V is the one a catch-up would write), then computes the known tokens past them, at
most the last accepted draft and the token after it (one or two rows, not the j + 1 of a run
that kept j drafts: a quantized draft's rows cost nearly a whole step each on CPU). A request
that ended, or that no longer fits, gives its pages back.

A self-draft (the target's own checkpoint, quantized: SpeculativeConfig.self_draft) has no cache
of its own: it reads and writes the target's (`shared_kv`), in the request's own pages. Its
context is the target's K/V of the known tokens, exact and already there, so a proposal is k
one-row forwards and nothing else: no prompt prefill in the draft, no catch-up after a
rejection (each costs a quantized multi-row forward, nearly a whole step a row on CPU):

    target cache:   known[:n-1] valid                  (num_computed = n - 1)
    one proposal:   decode y_t at n - 1 -> d1, d1 at n -> d2, ..., d_{k-1} at n + k - 2 -> dk

The draft's K/V lies at num_computed and past it, where the verify step writes the target's own
for the same positions before anything reads them (y_t d1 .. dk at n - 1 .. n + k - 1), and where
rejected drafts' K/V lies anyway: past the logical length, never read. The pages are the
request's own, reserved by the speculator for the run (Scheduler.try_extend) before it drafts.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from ...model.batch import ForwardBatch
from ...model.kv_cache import KVCache
from ...protocols import Model
from ..page_pool import PagePool
from ..request import Request
from .rejection import sample_drafts, takes_rejection


class Proposal(NamedTuple):
    tokens: list[int]                  # the drafts, in order
    probs: torch.Tensor | None         # (len(tokens), V): the q each was sampled from; None: greedy /
                                       # n-gram drafts, verified by exact match
    lookup: bool = False               # prompt lookup in the request's own tokens where its source is
                                       # another (a prediction, a draft model): scheduler.ScheduledSeq


@dataclass
class _DraftSeq:
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0
    ahead: list[int] = field(default_factory=list)   # drafts whose K/V lies from num_computed on

    def valid(self, req: Request) -> int:
        """Tokens of req whose draft K/V is valid: num_computed, and on past it each draft of
        `ahead` that the request's tokens repeat at its position (at most up to its last token,
        which is always computed again: its row gives d1)."""
        c, last = self.num_computed, req.num_tokens - 1
        for token in self.ahead:
            if c >= last or req.token_at(c) != token:
                break
            c += 1
        return min(c, last)


def top_probability(logits: torch.Tensor) -> list[float]:
    """Each row's softmax probability of its largest logit, exp(max - logsumexp) = 1 / sum(exp(x -
    max)). On CPU in numpy, on the calling thread: torch's reductions over a 49k vocabulary go to
    OpenMP's threads, whose join waits for a descheduled one (on a loaded 2-core machine, 80 ms a
    draft step of a few milliseconds)."""
    x = logits.detach().float()
    if x.device.type != "cpu":
        return torch.exp(x.amax(dim=-1) - torch.logsumexp(x, dim=-1)).tolist()
    a = x.numpy()
    shifted = a - a.max(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", over="ignore"):
        return (1.0 / np.exp(shifted).sum(axis=-1)).tolist()


def kv_fits(kv: KVCache, model: Model) -> bool:
    """Whether `model` can run on cache `kv` (a self-draft on the target's): its layers, KV heads
    and head size."""
    mc = model.config
    return tuple(kv.k.shape[i] for i in (0, 3, 4)) == (mc.num_layers, mc.num_kv_heads, mc.head_dim)


def load_draft(draft: Any, device: torch.device, dtype: torch.dtype, quantization: str | None = None) -> Model:
    """A pd.Model as given, or one loaded from a directory / GGUF file on the target's device
    and dtype, its float weights quantized when `quantization` names a format (a self-draft
    loads the target's own checkpoint so)."""
    if isinstance(draft, Model):
        if quantization is not None:
            raise ValueError("draft_quantization quantizes a checkpoint at load: give draft_model as a path "
                             "(or leave it out under Engine.from_pretrained for a self-draft), not a loaded model")
        return draft
    if isinstance(draft, (str, Path)):
        from ...model.loader import load_model
        model, _ = load_model(draft, device=str(device), dtype=dtype, quantization=quantization)
        return model
    raise TypeError(f"draft_model must be a pd.Model or a model path, got {type(draft).__name__}")


class DraftModelProposer:
    def __init__(self, model: Model, capacity_tokens: int, page_size: int, vocab_size: int,
                 rejection: bool = True, kv_dtype: torch.dtype | None = None, min_confidence: float = 0.0,
                 shared_kv: KVCache | None = None) -> None:
        """capacity_tokens: the target's KV capacity, which the draft's cache matches in tokens;
        kv_dtype: the target's kv_cache_dtype, which a float32 draft takes too (its cache then
        narrows as the target's does; any other draft keeps its own dtype); min_confidence: a
        run stops once the draft's own probability of its drafts so far falls below it
        (SpeculativeConfig.min_draft_confidence); shared_kv: the target's cache, for a self-draft
        (module docstring; its shape must be the draft's)."""
        mc = model.config
        self.model = model
        self.min_confidence = min_confidence
        self.rejection = rejection               # False: every draft greedy, verified by exact matching
        self.vocab_size = vocab_size             # draft ids past the target's vocabulary cut the draft
        self.page_size = page_size
        self.device = torch.device(getattr(model, "device", "cpu"))
        self.shared = shared_kv is not None
        num_pages = max(1, capacity_tokens // page_size) if shared_kv is None else 1   # the pool: unused
        self.pool = PagePool(num_pages)
        if shared_kv is not None:
            if not kv_fits(shared_kv, model):
                raise ValueError("a draft sharing the target's KV cache needs the target's layer and KV head shapes")
            self.kv = shared_kv
        else:
            dtype = kv_dtype if kv_dtype is not None and model.dtype == torch.float32 else model.dtype
            self.kv = KVCache(mc.num_layers, num_pages, page_size, mc.num_kv_heads, mc.head_dim, dtype, self.device)
        self.max_context = mc.max_context
        self._seqs: weakref.WeakKeyDictionary[Request, _DraftSeq] = weakref.WeakKeyDictionary()

    def pages_needed(self) -> bool:
        """Whether the speculator reserves the request's pages for a run before proposing (a
        shared cache: the drafts' K/V goes into the request's own pages)."""
        return self.shared

    def release_ended(self, live: set[int]) -> None:
        """Give back the pages of requests that are not running any more (ids of the running)."""
        for req in [r for r in self._seqs if id(r) not in live]:
            self._release(req)

    def _release(self, req: Request) -> None:
        seq = self._seqs.pop(req)
        if seq.pages:
            self.pool.release(reversed(seq.pages))

    def _reserve(self, req: Request, tokens: int) -> _DraftSeq | None:
        seq = self._seqs.get(req)
        if seq is None:
            seq = self._seqs[req] = _DraftSeq()
        need = -(-tokens // self.page_size) - len(seq.pages)
        if need > 0:
            pages = self.pool.allocate(need)
            if pages is None:
                return None
            seq.pages.extend(pages)
        return seq

    def propose(self, wants: list[tuple[Request, int]]) -> list[Proposal]:
        """wants: (request, k) pairs; returns each request's draft of up to k tokens, greedy or
        sampled (module docstring); empty when its draft pages or the draft's context do not
        allow one."""
        out: list[list[int]] = [[] for _ in wants]
        probs: list[list[torch.Tensor]] = [[] for _ in wants]
        sampled = [self.rejection and takes_rejection(req) for req, _ in wants]
        cut: dict[int, int] = {}                 # request -> drafts usable (a non-finite q cuts there)
        sure = [1.0] * len(wants)                # the draft's probability of each run's drafts so far
        rows: list[tuple[int, Request, list[int], int]] = []    # (i, request, its pages, k)
        drafted: list[_DraftSeq] = []
        for i, (req, k) in enumerate(wants):
            n = req.num_tokens
            k = min(k, self.max_context - n)
            if k > 0 and self.shared:
                rows.append((i, req, req.seq.pages, k))    # reserved for n + k - 1 positions by the caller
                continue
            seq = self._reserve(req, n + k - 1) if k > 0 else None
            if seq is not None:
                seq.num_computed, seq.ahead = seq.valid(req), []
                rows.append((i, req, seq.pages, k))
                drafted.append(seq)
        if not rows:
            return [Proposal([], None) for _ in wants]
        # step 0: the known tokens the draft has not seen, up to the last one -> d1 (a shared cache
        # has seen all but the last)
        starts = [r.num_tokens - 1 if self.shared else self._seqs[r].num_computed for _, r, _, _ in rows]
        chunks = [[r.token_at(p) for p in range(c, r.num_tokens)] for (_, r, _, _), c in zip(rows, starts)]
        logits = self._forward(chunks, starts, [p for _, _, p, _ in rows], [(r, []) for _, r, _, _ in rows])
        self._choose(logits, [(i, req) for i, req, _, _ in rows], 0, sampled, out, probs, cut, sure)
        for seq, (_, req, _, _) in zip(drafted, rows):
            seq.num_computed = req.num_tokens
        # steps 1 .. k - 1: decode the previous draft -> the next, while the draft is sure enough
        # of its run: a draft token costs a draft step and a verify row whether it is kept or not
        for step in range(1, max(k for *_, k in rows)):
            going = [(i, req, pages) for i, req, pages, k in rows if step < k and sure[i] >= self.min_confidence]
            if not going:
                break
            logits = self._forward([[out[i][-1]] for i, _, _ in going],
                                   [req.num_tokens + step - 1 for _, req, _ in going], [s for _, _, s in going],
                                   [(req, out[i]) for i, req, _ in going])
            self._choose(logits, [(i, req) for i, req, _ in going], step, sampled, out, probs, cut, sure)
        for seq, (i, _, _, _) in zip(drafted, rows):
            seq.ahead = out[i][:-1]              # fed to the draft by the steps above: their K/V is written
        proposals = []
        for i, draft in enumerate(out):
            bad = next((j for j, t in enumerate(draft) if t >= self.vocab_size), cut.get(i))
            if bad is not None:
                del draft[bad:]
            proposals.append(Proposal(draft, torch.stack(probs[i][:len(draft)]) if sampled[i] and draft else None))
        return proposals

    def _choose(self, logits: torch.Tensor, at: list[tuple[int, Request]], step: int, sampled: list[bool],
                out: list[list[int]], probs: list[list[torch.Tensor]], cut: dict[int, int], sure: list[float]) -> None:
        """Each row's draft at depth `step` (its request is wants[i]): the greedy next token, or one
        sampled from q at its output position (len(output_ids) + step), q kept in probs[i]; sure[i]
        is multiplied by the draft's probability of it (softmax of its logits, or q)."""
        tokens = logits.argmax(dim=-1).tolist()
        chance = top_probability(logits) if self.min_confidence else None
        rows = [r for r, (i, _) in enumerate(at) if sampled[i]]
        if rows:
            reqs = [at[r][1] for r in rows]
            drawn, q, usable = sample_drafts(logits[rows], reqs, [len(req.output_ids) + step for req in reqs],
                                             self.vocab_size)
            for n, r in enumerate(rows):
                i = at[r][0]
                tokens[r] = drawn[n]
                probs[i].append(q[n])
                if chance is not None:
                    chance[r] = float(q[n, drawn[n]])
                if not usable[n]:
                    cut.setdefault(i, step)
        for r, ((i, _), t) in enumerate(zip(at, tokens)):
            out[i].append(t)
            if chance is not None:
                sure[i] *= chance[r]

    def _forward(self, chunks: list[list[int]], starts: list[int], tables: list[list[int]],
                 known: list[tuple[Request, list[int]]]) -> torch.Tensor:
        """One varlen forward of the draft: chunk i at positions starts[i].., in pages tables[i];
        the logits after each chunk (one row per chunk). known: each chunk's request and the
        drafts before the chunk's end (host facts for test doubles, as in build_batch)."""
        ps = self.page_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        cu, lens, last = [0], [], []
        width = max(len(pages) for pages in tables)
        table: list[int] = []
        for chunk, start, pages in zip(chunks, starts, tables):
            for j, t in enumerate(chunk):
                p = start + j
                ids.append(t)
                pos.append(p)
                slots.append(pages[p // ps] * ps + p % ps)
            cu.append(len(ids))
            lens.append(start + len(chunk))
            last.append(len(ids) - 1)
            table.extend(pages + [-1] * (width - len(pages)))
        decode = all(len(c) == 1 for c in chunks)
        dev = self.device
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, device=dev), positions=torch.tensor(pos, device=dev),
            slot_mapping=torch.tensor(slots, device=dev),
            page_table=torch.tensor(table, dtype=torch.int32, device=dev).view(len(tables), width),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev), cu_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            logits_indices=torch.tensor(last, device=dev), num_decode=len(tables) if decode else 0,
            max_new=max(len(c) for c in chunks), request_ids=[r.request_id for r, _ in known],
            token_ids=[r.prompt_ids for r, _ in known], output_ids=[r.output_ids + d for r, d in known],
            logits_seqs=list(range(len(tables))))
        return self.model.forward(batch, self.kv)
