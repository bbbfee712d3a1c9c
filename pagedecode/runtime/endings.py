"""Endings: every way a request ends. Cancels (asked any time, effective at a safe point), the
safe point's checks (cancels, deadlines, grammar failures, the backpressure "fail" policy), a
normal finish, a failure, and the release of every resource exactly once.

A normal end drains what the output pipeline holds (DRAINING) and then FINISHES; any other end
is a single transition to its terminal state; either way the terminal event goes out with it
(through Delivery) and the request's pages and slot go back through the scheduler. Every method
but `cancel` / `cancel_all` runs under the engine's lock (the step holds it); those take it.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from .config import EngineConfig
from .output.delivery import Delivery
from .output.events import Event
from .lifecycle import FinishReason, RequestState
from .registry import RequestRegistry
from .request import RESOURCES, Request
from .scheduler import Scheduler, SchedulerOutput

log = logging.getLogger("pagedecode")


ENDED = (RequestState.DRAINING, RequestState.FINISHED, RequestState.CANCELLED, RequestState.FAILED)


class Endings:
    def __init__(self, scheduler: Scheduler, requests: RequestRegistry, delivery: Delivery, config: EngineConfig,
                 lock: threading.RLock, wake: Callable[[], None]) -> None:
        self.scheduler = scheduler
        self.requests = requests
        self.delivery = delivery
        self.backpressure_fails = config.backpressure == "fail"
        self.backpressure_timeout_s = config.backpressure_timeout_s
        self._lock = lock
        self._wake = wake

    # -- asked from any thread ------------------------------------------------------------------
    def cancel(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> bool:
        """Ask to cancel; effective at the next safe point. False when the request is unknown,
        terminal, or its finish reason is already fixed (draining)."""
        with self._lock:
            req = self.requests.live.get(request_id)
            if req is None or req.state in ENDED:
                return False
            if req.state != RequestState.CANCEL_REQUESTED:
                req.trace.add("cancel.requested", reason=reason.value)
                req.cancel_reason = reason
                req.transition(RequestState.CANCEL_REQUESTED)      # observed: nothing more is scheduled
                req.trace.add("cancel.observed")
        self._wake()
        return True

    def cancel_all(self, reason: FinishReason = FinishReason.CANCELLED) -> int:
        """Ask every live request to cancel; returns how many were asked."""
        with self._lock:
            return sum(self.cancel(rid, reason) for rid in list(self.requests.live))

    # -- under the lock ------------------------------------------------------------------------
    def stop_hit(self, req: Request, stop: str | tuple[int, ...]) -> None:
        req.stop_reason = stop[0] if isinstance(stop, tuple) and len(stop) == 1 else stop
        req.trace.add("stop.hit", stop=req.stop_reason, rule_version=1)

    # -- endings ----------------------------------------------------------------------------
    def finish(self, req: Request, reason: FinishReason, events: list[Event]) -> None:
        """A normal end: fix the reason (DRAINING), flush what is held, then FINISHED."""
        req.transition(RequestState.DRAINING)
        req.finish_reason = reason
        if reason != FinishReason.STOP_SEQUENCE and req.pipeline is not None:
            em = req.pipeline.finish("drop" if reason == FinishReason.DEADLINE_EXCEEDED else None)
            self.delivery.deliver(req, em, events)
            if em.stop is not None:
                self.stop_hit(req, em.stop)
                reason = FinishReason.STOP_SEQUENCE
            if em.error is not None:
                self.terminate(req, RequestState.FAILED, FinishReason.CONTENT_INTERRUPTED, em.error, events)
                return
        self.terminate(req, RequestState.FINISHED, reason, None, events)

    def fail(self, req: Request, exc: BaseException, events: list[Event]) -> None:
        if req.state.terminal:
            log.exception("request %s failed after it ended", req.request_id)
            return
        self.terminate(req, RequestState.FAILED, FinishReason.MODEL_ERROR, f"{type(exc).__name__}: {exc}", events)

    def terminate(self, req: Request, state: RequestState, reason: FinishReason, error: str | None,
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
        self.release_all(req)
        self.requests.finish(req)

    def release_all(self, req: Request) -> None:
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

    def fail_step(self, plan: SchedulerOutput, exc: BaseException | None, events: list[Event]) -> None:
        log.error("model step failed: %s: %s", type(exc).__name__, exc)
        for s in plan.seqs:
            req = s.request
            if not req.state.terminal and req.state != RequestState.CANCEL_REQUESTED:
                self.terminate(req, RequestState.FAILED, FinishReason.MODEL_ERROR,
                               f"model step failed: {type(exc).__name__}: {exc}", events)

    def safe_point(self, events: list[Event]) -> None:
        now = time.perf_counter()
        for req in list(self.requests.live.values()):
            if req.state == RequestState.CANCEL_REQUESTED:
                req.trace.add("cancel.effective")
                self.terminate(req, RequestState.CANCELLED, req.cancel_reason, None, events)
            elif (req.first_token_deadline is not None and not req.output_ids
                  and now >= req.first_token_deadline):
                req.trace.add("deadline", state=req.state.value, first_token=True)
                self.terminate(req, RequestState.FAILED, FinishReason.DEADLINE_EXCEEDED,
                               f"no first token within {req.params.first_token_timeout_s}s", events)
            elif req.deadline is not None and now >= req.deadline:
                req.trace.add("deadline", state=req.state.value)
                if req.state == RequestState.DECODING:
                    self.finish(req, FinishReason.DEADLINE_EXCEEDED, events)
                else:
                    self.terminate(req, RequestState.FAILED, FinishReason.DEADLINE_EXCEEDED,
                                   "deadline passed before decoding started", events)
            elif req.grammar is not None and (why := req.grammar.failure()) is not None:
                self.terminate(req, RequestState.FAILED, FinishReason.MODEL_ERROR, why, events)
            elif ((paused := req.delivery.paused_since) is not None and self.backpressure_fails
                  and now - paused > self.backpressure_timeout_s):
                self.terminate(req, RequestState.FAILED, FinishReason.TRANSPORT_ERROR,
                               f"consumer did not read for {self.backpressure_timeout_s}s", events)
