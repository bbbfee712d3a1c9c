"""Commit: a step's selections become each request's progress and tokens, under the engine's lock.

Per scheduled sequence, in row order: the scheduler advances it (its K/V is in its pages), its
prompt logprobs are kept, and a sampling sequence takes its token: the token is appended, the
grammar advanced, the text pushed through the output pipeline and delivered, and the endings
(EOS, stops, length, context, grammar) checked. A sequence cancelled while the step ran is
skipped (its result is discarded); an exception while committing one request fails that request
only. Verify sequences (drafts) are returned to the engine, which hands them to the Speculator:
it takes their tokens through `select` and `take` here (speculative.py's Host).
"""
from __future__ import annotations

from typing import Callable

import torch

from .output.delivery import Delivery
from .endings import Endings
from .output.events import Event, TopLogprobs
from .finish_rules import check_ending, is_eos, nothing_allowed
from .grammar import Constraints
from .lifecycle import FinishReason, RequestState
from .request import Request
from .scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from .selector import Selection, TokenSelector


class Commit:
    def __init__(self, scheduler: Scheduler, endings: Endings, delivery: Delivery, constraints: Constraints,
                 selector: TokenSelector, select: Callable[[torch.Tensor, list[Request]], Selection],
                 eos_ids: frozenset[int], max_context: int) -> None:
        self.scheduler = scheduler
        self.endings = endings
        self.delivery = delivery
        self.constraints = constraints
        self.selector = selector             # the Speculator chooses draft rows up front with it
        self.select = select                 # the runner's selection (the Speculator's later depths)
        self.eos_ids = eos_ids
        self.max_context = max_context
        self.generated_tokens = 0            # tokens chosen, for the engine's snapshot

    def seqs(self, plan: SchedulerOutput, sel: Selection, dt: float, events: list[Event]
             ) -> list[tuple[ScheduledSeq, int]]:
        """Commit each sequence of a step of dt seconds; returns the verify sequences still to
        commit, each with its row of the first selection."""
        row = 0
        runs: list[tuple[ScheduledSeq, int]] = []
        for k, s in enumerate(plan.seqs):
            req, i = s.request, row
            row += s.samples
            if req.state == RequestState.CANCEL_REQUESTED or req.state.terminal:
                continue                        # cancelled while the step ran: its result is discarded
            try:
                self.scheduler.advance(req, s.num_new, len(s.drafts))   # drafts count once accepted
                req.computed(s.num_new, dt)
                if sel.prompt is not None and k in sel.prompt:
                    req.add_prompt_logprobs(*sel.prompt[k])
                if s.samples and req.params.max_tokens == 0:      # prompt logprobs only: no token
                    self.endings.finish(req, FinishReason.MAX_OUTPUT_TOKENS, events)
                elif s.drafts:
                    runs.append((s, i))
                elif s.samples:
                    self.take(req, sel, i, events)
            except Exception as exc:
                self.endings.fail(req, exc, events)
        return runs

    def take(self, req: Request, sel: Selection, i: int, events: list[Event]) -> None:
        """Commit row i's selection as req's next token (its endings checked)."""
        if i in sel.bad:
            raise FloatingPointError("the model returned non-finite logits (NaN or inf) for it")
        if i in sel.empty:
            raise RuntimeError(nothing_allowed(req))
        self.token(req, sel.tokens[i], None if sel.logprobs is None else sel.logprobs[i],
                   None if sel.top is None else sel.top[i], events)

    def fail(self, req: Request, exc: BaseException, events: list[Event]) -> None:
        self.endings.fail(req, exc, events)

    def accept_draft(self, req: Request) -> None:
        self.scheduler.accept_draft(req)        # its draft was selected: that K/V is valid

    def after_verify(self, req: Request) -> None:
        """A verify run is taken: the pages its accepted tokens filled are keyed, the rest trimmed."""
        if not (req.state.terminal or req.state == RequestState.CANCEL_REQUESTED):   # ended: gave back everything
            self.scheduler.settle(req)

    def token(self, req: Request, token: int, logprob: float | None, top: TopLogprobs | None,
              events: list[Event]) -> None:
        """req's next token: appended, its grammar advanced, its text delivered, its endings checked."""
        req.output_ids.append(token)
        self.generated_tokens += 1
        t = len(req.output_ids)
        if req.state == RequestState.PREFILLING:
            req.transition(RequestState.DECODING)
        if req.trace.tokens:
            p = req.params
            req.trace.token("token.selected", t=t, token=token, logprob=logprob, cache_len=req.seq.num_computed,
                            temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, seed=req.seed)
        grammar_done = req.grammar is not None and self.constraints.take(req, token)   # before its text is sent
        stop = None
        if not is_eos(req, token, self.eos_ids):
            assert req.pipeline is not None, "a live request has its output pipeline"
            em = req.pipeline.push(token, logprob, t, top)
            self.delivery.deliver(req, em, events)
            stop = em.stop
            if stop is not None:
                self.endings.stop_hit(req, stop)
        if not grammar_done and stop is None and req.grammar is not None:
            grammar_done = self.constraints.ends_after(req, token, self.eos_ids)
        reason = check_ending(req, token, stop, self.eos_ids, self.max_context, grammar_done)
        if reason is not None:
            self.endings.finish(req, reason, events)
