"""Speculative decoding: propose a few tokens per decoding request, verify them in the same
forward pass as everything else, and keep exactly the tokens the engine would have chosen
without speculation (exact matching, below: matching.py), or, for a draft model's sampled
drafts, tokens with exactly the target's distribution (the rejection rule: rejection.py).

A verify step for a request with m prompt tokens and t selected (docs/design.md, "Step state"):

    known:      prompt (m) | y1 .. yt                     num_computed = m + t - 1
    computed:                   yt  d1  d2 .. dk          positions m+t-1 .. m+t-1+k
    rows:                       r0  r1  r2 .. rk          r_j chooses y_{t+1+j}

Row r0 is chosen like any decode row (in StepRunner.run). Then, one depth at a time, for every
request whose token at depth j - 1 equalled d_j and that did not end on it: d_j is accepted
(num_computed + 1), and row r_j chooses the next token through the engine's own selection and
commit path (penalties, bias, min_tokens, grammar mask, temperature, filters, the Philox stream
at that output index, then EOS, stops, hold-back, length, context). So every selected token is
the one non-speculative decoding selects, and an ending cuts the run at the same token. K/V
written for rejected drafts lies past num_computed: it is never read (attention reads
seq_lens, which the next step sets from num_computed), the next step overwrites it, and pages
holding only such K/V go back to the pool (Scheduler.trim).

Proposals come from the request's own prompt and output only (ngram.py; nothing is
shared between requests), or from a draft model on its own paged KV, or a self-draft on the
target's (draft_model.py): by its
greedy decoding, verified as above, or, for a sampling request that needs nothing per position
beyond temperature / top-k / top-p / min-p (spec_rejection.takes_rejection), sampled from a
distribution q it records and verified by the rejection rule (rejection.py; those runs
carry draft_probs). Gates keep speculation where it pays: no proposals while more than
`max_batch` requests decode; a request proposes as many tokens as its runs have earned (from 2,
doubling up to k on a run kept whole), and one whose rolling acceptance falls below
`min_acceptance` proposes nothing for `backoff_steps` steps (doubling on each new miss, reset by
a fully accepted run); a measured step-cost gate stops them at a batch size where they do not
pay (gates.py).
"""
from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass

import torch

from ...model.kv_cache import KVCache
from ...protocols import Model
from ..config import SpeculativeConfig
from ..lifecycle import RequestState
from ..output.events import Event
from ..request import Request
from ..scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from ..selector import Selection, TokenSelector
from .draft_model import DraftModelProposer, Proposal, kv_fits, load_draft
from .gates import FIRST_DRAFT, PREDICTION_DRAFT, SHADOW_DRAFT, SHADOW_FOLLOWED, CostGate, Gate
from .ngram import NgramProposer
from .matching import verify_matched
from .rejection import verify_sampled
from .verify_run import Host, VerifyRun

log = logging.getLogger("pagedecode")


@dataclass
class SpecCounters:
    drafts: int = 0              # verify runs (a request with k > 0 drafts in a step)
    draft_tokens: int = 0        # tokens proposed and verified
    accepted_tokens: int = 0     # ... and of them selected
    gated: int = 0               # times a request's acceptance gate turned its proposals off
    lookup_tokens: int = 0       # of draft_tokens, those prompt lookup proposed backing another source


class Speculator:
    """The engine's speculation component: extends a plan with drafts, then, after the step's
    first tokens are committed, verifies the drafts one depth at a time."""

    def __init__(self, config: SpeculativeConfig | None, max_context: int, page_size: int, target: Model,
                 capacity_tokens: int, deterministic: bool = False, kv_dtype: torch.dtype | None = None,
                 kv: KVCache | None = None) -> None:
        """config None: speculation is off, except for requests that bring a prediction
        (Predicted Outputs), which draft from it with the default config's gates. kv: the
        target's cache, which a self-draft reads and writes (draft_model.py) where it fits."""
        self.general = config is not None        # every request proposes, not only predicted ones
        self.config = config = config if config is not None else SpeculativeConfig()
        self.max_context = max_context
        self.page_size = page_size
        self.ngram = NgramProposer(config.min_ngram, config.max_ngram)
        self.draft: DraftModelProposer | None = None
        if self.general and config.method == "draft":
            if config.draft_model is None:
                raise ValueError("a self-draft (draft_quantization without draft_model) loads the target's "
                                 "checkpoint: build the engine with Engine.from_pretrained")
            device = torch.device(getattr(target, "device", "cpu"))
            model = load_draft(config.draft_model, device, self._draft_dtype(config, target, device),
                               config.draft_quantization)
            # a self-draft on the target's own cache, where it runs in this process on its shape (a
            # tensor-parallel target's cache holds this rank's heads only)
            shared = kv if config.self_draft and kv is not None and kv_fits(kv, model) else None
            # deterministic mode keeps exact matching for every request: a seeded request's tokens
            # must not depend on the verify schedule, which other requests shape
            self.draft = DraftModelProposer(model, capacity_tokens, page_size, target.config.vocab_size,
                                            rejection=not deterministic, kv_dtype=kv_dtype,
                                            min_confidence=config.min_draft_confidence, shared_kv=shared)
        self.counters = SpecCounters()
        self.cost = CostGate(config.min_gain, config.backoff_steps)
        self._gates: weakref.WeakKeyDictionary[Request, Gate] = weakref.WeakKeyDictionary()
        self._own_gates: weakref.WeakKeyDictionary[Request, Gate] = weakref.WeakKeyDictionary()   # _lookup's
        # what prompt lookup would have proposed while its gate was off: (output length then, drafts)
        self._shadows: weakref.WeakKeyDictionary[Request, tuple[int, list[int]]] = weakref.WeakKeyDictionary()
        self._step = 0

    @staticmethod
    def _draft_dtype(config: SpeculativeConfig, target: Model, device: torch.device) -> torch.dtype:
        """The target's dtype, except for a quantized self-draft of a bfloat16 / float16 target on
        CPU: it computes in float32 on the target's narrower cache (which a float32 model takes, as
        kv_cache_dtype does). Its quantized matmuls run in float32 either way (csrc quant_linear);
        computing in bfloat16 around them, a q4_0 SmolLM2-135M step took as long as the bfloat16
        target's own (66.9 ms to 65.1, medians on a loaded 2-core AVX2 machine), in float32 38.6 ms."""
        if config.self_draft and config.draft_quantization is not None and device.type == "cpu":
            return torch.float32
        return target.dtype

    # -- before the forward ---------------------------------------------------------------------
    def extend(self, plan: SchedulerOutput, scheduler: Scheduler, budget: int) -> None:
        """Turn decode seqs into verify seqs (1 + k tokens) where a draft is found, pages are free
        and the step's token budget allows; the others stay plain decodes."""
        if not self.general and not any(s.request.prediction is not None for s in plan.decode):
            return
        # the step is timed from here: its drafting (a draft model's forwards) is part of its cost
        now = time.perf_counter()
        self._step += 1
        if self.draft is not None:
            self.draft.release_ended({id(r) for r in scheduler.running})
        batch = len(plan.decode)
        timed = not plan.prefill and batch > 0
        if not plan.decode or batch > self.config.max_batch or not self.cost.allows(batch, self._step):
            self.cost.start(now, self._step, batch, False, batch, timed)
            return
        wants: list[tuple[ScheduledSeq, int]] = []
        for s in plan.decode:
            req = s.request
            k = min(budget, self._room(req))
            if k > 0 and req.state == RequestState.DECODING and (self.general or req.prediction is not None):
                # a draft on the target's cache writes the run's K/V into the request's own pages
                if self._writes_pages(req) and not scheduler.try_extend(req, 1 + k):
                    continue
                wants.append((s, k))
                budget -= k
        drafted = self._propose([(s.request, k) for s, k in wants])
        for (s, _), (drafts, probs, lookup) in zip(wants, drafted):
            req = s.request
            if req.grammar is not None:          # never sampled drafts (spec_rejection.takes_rejection)
                drafts = self._grammar_allows(req, drafts)
            if drafts and scheduler.try_extend(req, 1 + len(drafts)):
                plan.decode.remove(s)
                plan.verify.append(ScheduledSeq(req, 1 + len(drafts), True, tuple(drafts), probs, lookup))
            elif self._writes_pages(req):
                scheduler.trim(req)              # pages reserved for drafts that did not come
        self.cost.start(now, self._step, batch, bool(plan.verify), batch, timed)

    @staticmethod
    def _grammar_allows(req: Request, drafts: list[int]) -> list[int]:
        """The drafts up to the first one the request's grammar forbids after those before it:
        its matcher is advanced over them and rolled back (xgrammar's rollback), so it is where
        it was; a forbidden draft could only be rejected, and would cost its row."""
        assert req.grammar is not None
        matcher = req.grammar.matcher
        if matcher is None or not drafts:
            return []
        n = 0
        for token in drafts:
            if not matcher.accept_token(token):
                break
            n += 1
        if n:
            matcher.rollback(n)
        if n < len(drafts):
            req.trace.add("spec.cut", proposed=len(drafts), allowed=n)
        return drafts[:n]

    def _writes_pages(self, req: Request) -> bool:
        """Whether this request's proposal writes into its own pages (a self-draft on the target's
        cache; a prediction drafts without a forward)."""
        return self.draft is not None and self.draft.pages_needed() and req.prediction is None

    def _room(self, req: Request) -> int:
        """Drafts that can still matter: y_{t+1+j} must stay within max_tokens, and the positions
        written within the context (the context-limit ending then fires where it would anyway)."""
        t = len(req.output_ids)
        gates = [self._gate(req)] + ([self._lookup_gate(req)] if self._looks_up(req) else [])
        length = max(self._length(g) for g in gates)
        return min(length, req.params.max_tokens - t - 1, self.max_context - req.num_tokens - 1)

    def _length(self, gate: Gate) -> int:
        """The drafts a gate lets its source propose now: none while it is turned off."""
        return gate.length if gate.off_until <= self._step else 0

    def _looks_up(self, req: Request) -> bool:
        """Whether prompt lookup backs the request's own draft source: a prediction's (where the
        output has left it), a draft model's with SpeculativeConfig.prompt_lookup."""
        return req.prediction is not None or (self.draft is not None and self.config.prompt_lookup)

    def _lookup(self, req: Request, k: int) -> Proposal:
        """Prompt lookup's drafts for a request whose own source is another, under their own gate
        (a lookup's misses must not shorten the other source's runs, nor its misses the lookup's).
        While that gate is off, what lookup would have proposed is kept until the output leaves it:
        _room, which sizes every run before it is proposed, judges it once a step (_lookup_gate),
        so the tokens that follow it count over as many steps as they take."""
        gate = self._gate(req, own=True)
        if gate.off_until > self._step:
            # one shorter than SHADOW_FOLLOWED could never reopen the gate: not kept (kept, it held
            # its place for the gate's whole off period when the output followed it to its end)
            if req not in self._shadows and len(shadow := self.ngram.propose_for(req, SHADOW_DRAFT)) >= SHADOW_FOLLOWED:
                self._shadows[req] = (len(req.output_ids), shadow)
            return Proposal([], None, True)
        return Proposal(self.ngram.propose_for(req, min(k, gate.length)), None, True)

    def _lookup_gate(self, req: Request) -> Gate:
        """The gate of a request's prompt lookup (backing another source), turned back on where the
        output has followed what lookup would have proposed while it was off: at least
        SHADOW_FOLLOWED tokens of it, each the same (a copy that went on past a rewritten passage;
        off, it waited out its back-off while the other source drafted the copy a few tokens a run).
        Lookup costs no forward to ask, so it is asked while off; only its runs cost rows."""
        gate = self._gate(req, own=True)
        if gate.off_until <= self._step:
            self._shadows.pop(req, None)         # evidence for one off period, not the next
            return gate
        kept = self._shadows.get(req)
        if kept is None:
            return gate
        at, shadow = kept
        since = req.output_ids[at:at + len(shadow)]
        if since != shadow[:len(since)]:
            del self._shadows[req]               # the output went elsewhere
        elif len(since) >= SHADOW_FOLLOWED:
            del self._shadows[req]
            gate.reopen(self._step, 2 * len(since), self.config.backoff_steps)
            req.trace.add("spec.lookup_reopened", followed=len(since))
        return gate

    def _propose(self, wants: list[tuple[Request, int]]) -> list[Proposal]:
        """Each request's drafts, each source under its own gate: a prediction, or prompt lookup
        where the output has left it; the n-gram; or the draft model, after prompt lookup where
        SpeculativeConfig.prompt_lookup asks for it."""
        out = [Proposal([], None)] * len(wants)
        drafting: list[tuple[int, Request, int]] = []           # (index, request, k) for the draft model
        for i, (req, k) in enumerate(wants):
            if req.prediction is not None:
                drafts = req.prediction.propose(req.output_ids, min(k, self._length(self._gate(req))))
                out[i] = Proposal(drafts, None) if drafts else self._lookup(req, k)
            elif self.draft is None:
                out[i] = Proposal(self.ngram.propose_for(req, k), None)
            elif self.config.prompt_lookup and (found := self._lookup(req, k)).tokens:
                out[i] = found
            elif (gated := min(k, self._length(self._gate(req)))) > 0:
                drafting.append((i, req, gated))
        for (i, _, _), proposal in zip(drafting, self._draft_model([(req, k) for _, req, k in drafting])):
            out[i] = proposal
        return out

    def _draft_model(self, wants: list[tuple[Request, int]]) -> list[Proposal]:
        if not wants or self.draft is None:
            return []
        try:
            return self.draft.propose(wants)
        except Exception:                            # a draft fault costs speculation, never a request
            log.exception("the draft model failed: this step runs without drafts")
            return [Proposal([], None) for _ in wants]

    # -- at the commit ------------------------------------------------------------------------------
    def verify(self, planned: list[ScheduledSeq], runs: list[tuple[ScheduledSeq, int]], first: Selection,
               logits: torch.Tensor, host: Host, events: list[Event]) -> None:
        """planned: the step's verify seqs, in row order; logits (sum of their k, V): the rows
        after each draft. runs: those still to commit (not cancelled while the step ran), each
        with its row in `first`, the selection of row r0. Runs whose drafts were sampled
        (draft_probs) take the rejection rule (rejection.py, which reads row r0 from
        first.chooser_logits); the others exact match (matching.py)."""
        verify_runs, left, offset = [], iter(runs), 0
        nxt = next(left, None)
        for s in planned:                            # runs keep the plan's order (commit.seqs)
            if nxt is not None and nxt[0] is s:
                s.request.draft_tokens += len(s.drafts)      # before any ending sends the usage out
                if s.request.prediction is not None and not s.lookup:
                    s.request.prediction.drafted += len(s.drafts)
                verify_runs.append(VerifyRun(s, nxt[1], offset, self._trace(s)))
                nxt = next(left, None)
            offset += len(s.drafts)
        assert nxt is None, "verify runs out of the plan's order"
        sampled = [run for run in verify_runs if run.seq.draft_probs is not None]
        if sampled:
            assert first.chooser_logits is not None
            verify_sampled(sampled, first.chooser_logits, logits, host, events)
        verify_matched([run for run in verify_runs if run.seq.draft_probs is None], first, logits, host, events)
        for run in verify_runs:
            self._record(run.seq, run.accepted)
            host.after_verify(run.request)

    @staticmethod
    def _trace(s: ScheduledSeq) -> dict | None:
        """The run's trace record (level "tokens"), completed as its tokens are taken: it is
        written before any of them, so it is there even when one of them ends the request."""
        req = s.request
        req.trace.token("spec.verify", proposed=len(s.drafts), drafts=s.drafts, accepted=0, bonus=None,
                        cache_len=req.seq.num_computed, rule="match" if s.draft_probs is None else "rejection")
        return req.trace.records[-1] if req.trace.tokens and req.trace.records else None

    def _record(self, s: ScheduledSeq, accepted: int) -> None:
        req, k = s.request, len(s.drafts)
        c = self.counters
        c.drafts += 1
        c.draft_tokens += k
        c.accepted_tokens += accepted
        c.lookup_tokens += k if s.lookup else 0
        self.cost.add_tokens(accepted)
        gate = self._gate(req, own=s.lookup)
        if gate.record(accepted, k, self._step, self.config.min_acceptance, self.config.backoff_steps):
            c.gated += 1
            req.trace.add("spec.gated", steps=gate.off_until - self._step)

    def _gate(self, req: Request, own: bool = False) -> Gate:
        """The request's gate; own: its prompt lookup's, where that backs another source (_looks_up)."""
        table = self._own_gates if own else self._gates
        gate = table.get(req)
        if gate is None:
            most = self.config.num_tokens
            if req.prediction is not None or own:
                most = max(most, PREDICTION_DRAFT)
            # runs whose source sizes them need not earn their length: a draft model's that stops
            # where it is unsure, and a prediction's, whose cursor proposes only where the output
            # follows it (after a divergence nothing until it re-synchronises): a miss costs one
            # run's rows, where earning the length back after every edit cost 2-3 steps each
            # (SmolLM2-135M's code edits: 85 -> 65 steps for 666 tokens)
            sized = req.prediction is not None or (self.draft is not None and self.config.min_draft_confidence > 0)
            earns = own or not sized
            first = most if self.config.min_acceptance == 0 or not earns else FIRST_DRAFT
            gate = table[req] = Gate(most, self.config.backoff_steps, length=first, earns=earns)
        return gate
