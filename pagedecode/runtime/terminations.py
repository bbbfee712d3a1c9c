"""How a request ends, and the events it sends out: a mixin of Engine (engine.py keeps the step).
Every method runs under the engine's lock. A normal end drains what the output pipeline holds
(DRAINING) and then FINISHES; any other end is a single transition to its terminal state; either
way the terminal event goes out with it and every resource is released exactly once.
"""
from __future__ import annotations

import logging
import time

from .config import EngineConfig
from .delivery import Delivery
from .events import Event
from .lifecycle import FinishReason, RequestState
from .registry import RequestRegistry
from .request import RESOURCES, Request
from .scheduler import Scheduler, SchedulerOutput

log = logging.getLogger("pagedecode")
S, R = RequestState, FinishReason


class RequestEndings:
    config: EngineConfig
    scheduler: Scheduler
    requests: RequestRegistry
    delivery: Delivery

    def _stop_hit(self, req: Request, stop: str | tuple[int, ...]) -> None:
        req.stop_reason = stop[0] if isinstance(stop, tuple) and len(stop) == 1 else stop
        req.trace.add("stop.hit", stop=req.stop_reason, rule_version=1)

    # -- endings ----------------------------------------------------------------------------
    def _finish(self, req: Request, reason: FinishReason, events: list[Event]) -> None:
        """A normal end: fix the reason (DRAINING), flush what is held, then FINISHED."""
        req.transition(S.DRAINING)
        req.finish_reason = reason
        if reason != R.STOP_SEQUENCE and req.pipeline is not None:
            em = req.pipeline.finish("drop" if reason == R.DEADLINE_EXCEEDED else None)
            self.delivery.deliver(req, em, events)
            if em.stop is not None:
                self._stop_hit(req, em.stop)
                reason = R.STOP_SEQUENCE
            if em.error is not None:
                self._terminate(req, S.FAILED, R.CONTENT_INTERRUPTED, em.error, events)
                return
        self._terminate(req, S.FINISHED, reason, None, events)

    def _fail(self, req: Request, exc: BaseException, events: list[Event]) -> None:
        if req.state.terminal:
            log.exception("request %s failed after it ended", req.request_id)
            return
        self._terminate(req, S.FAILED, R.MODEL_ERROR, f"{type(exc).__name__}: {exc}", events)

    def _terminate(self, req: Request, state: RequestState, reason: FinishReason, error: str | None,
                   events: list[Event]) -> None:
        """Fix the terminal state and emit the terminal event together (caller holds the lock),
        then release every resource once."""
        req.transition(state)
        req.finish_reason = reason
        req.error = error
        if req.pipeline is not None:
            req.timings.hold_s = req.pipeline.hold_s
        req.trace.add("finish", state=state.value, reason=reason.value, error=error)
        self.delivery.terminal(req, state, reason, error, events)
        self._release_all(req)
        self.requests.finish(req)

    def _release_all(self, req: Request) -> None:
        """Pages and slot go back through the scheduler, which owns them; the rest is dropped
        here. Each is marked once (a second release raises); a failing one is logged and the
        others still go."""
        try:
            self.scheduler.release(req)
        except Exception:
            log.exception("releasing the pages and slot of request %s failed", req.request_id)
        for resource in RESOURCES:
            req.mark_released(resource)
            req.trace.add("release", resource=resource)
        # "rng": the seed is the whole generator state; "stream": its history ends with the
        # terminal event (kept compactly for replay); "trace": closed below
        req.trace.closed = True
        req.grammar = None
        req.compact()

    def _fail_step(self, plan: SchedulerOutput, exc: BaseException | None, events: list[Event]) -> None:
        log.error("model step failed: %s: %s", type(exc).__name__, exc)
        for s in plan.seqs:
            req = s.request
            if not req.state.terminal and req.state != S.CANCEL_REQUESTED:
                self._terminate(req, S.FAILED, R.MODEL_ERROR, f"model step failed: {type(exc).__name__}: {exc}",
                                events)

    def _safe_point(self, events: list[Event]) -> None:
        now = time.perf_counter()
        for req in list(self.requests.live.values()):
            if req.state == S.CANCEL_REQUESTED:
                req.trace.add("cancel.effective")
                self._terminate(req, S.CANCELLED, req.cancel_reason, None, events)
            elif (req.first_token_deadline is not None and not req.output_ids
                  and now >= req.first_token_deadline):
                req.trace.add("deadline", state=req.state.value, first_token=True)
                self._terminate(req, S.FAILED, R.DEADLINE_EXCEEDED,
                                f"no first token within {req.params.first_token_timeout_s}s", events)
            elif req.deadline is not None and now >= req.deadline:
                req.trace.add("deadline", state=req.state.value)
                if req.state == S.DECODING:
                    self._finish(req, R.DEADLINE_EXCEEDED, events)
                else:
                    self._terminate(req, S.FAILED, R.DEADLINE_EXCEEDED,
                                    "deadline passed before decoding started", events)
            elif req.grammar is not None and (why := req.grammar.failure()) is not None:
                self._terminate(req, S.FAILED, R.MODEL_ERROR, why, events)
            elif ((paused := req.delivery.paused_since) is not None and self.config.backpressure == "fail"
                  and now - paused > self.config.backpressure_timeout_s):
                self._terminate(req, S.FAILED, R.TRANSPORT_ERROR,
                                f"consumer did not read for {self.config.backpressure_timeout_s}s", events)
