"""Delivery: how a request's events reach whoever reads them. One path for every consumer.

Every event a request emits is appended to its history (`DeliveryRecord.history`; seq n is
history[n], so the next seq is its length). A consumer reads the history after its own cursor
(`replay`, or `AsyncEngine.submit` / `follow`); one consumer may hold the request back: a
request added with acked=True has an ack cursor, and while stream_max_events events (or
stream_max_bytes of text) past it are unacked, the request is not scheduled (backpressure).
`ack` moves the cursor; `read_events` reads past it and acks what it returns, for a caller that
steps the engine itself. A finished request's history is kept compactly (history.py) within the
registry's budgets, for results and replay.

Every method that touches a record takes the engine's lock (given to the constructor); `wake`
tells the step loop there is work (an ack that lifts a pause).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Protocol

from ..lifecycle import FinishReason, RequestState
from .events import DeltaEvent, Event, StartEvent, TerminalEvent, Usage
from .history import CompactHistory
from .result import RequestOutput

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..registry import RequestRegistry
    from ..request import Request
    from .pipeline import Emission


class Attachment(Protocol):
    """What a caller keeps with a request (the server's Track): it lives exactly as long as the
    engine keeps the request, and its bytes count against the finished budget."""

    def kept_bytes(self) -> int: ...


@dataclass(eq=False)
class DeliveryRecord:
    """A request's events and who holds it back; written by Delivery only."""
    history: list[Event] | CompactHistory = field(default_factory=list)   # compacted when it ends
    cursor: int | None = None             # acked: every event up to this seq is taken (None: no
                                          # consumer holds the request back)
    paused_since: float | None = None     # backpressure: too much unacked since
    unacked_at: deque[float] = field(default_factory=deque)   # when each event past the cursor came
    send_s: float = 0.0                   # summed time events waited past the cursor (Timings.send_s)
    attachment: Attachment | None = None

    @property
    def newest(self) -> int:
        """The seq of the newest event (-1 before the first)."""
        return len(self.history) - 1

    def deltas(self) -> list[DeltaEvent]:
        if isinstance(self.history, CompactHistory):
            return self.history.deltas()
        return [e for e in self.history if isinstance(e, DeltaEvent)]

    def kept_bytes(self) -> int:
        h = self.history
        history = h.kept_bytes() if isinstance(h, CompactHistory) else 230 * len(h)
        return history + (0 if self.attachment is None else self.attachment.kept_bytes())


def usage(req: Request) -> Usage:
    """Counts are lengths; what was returned is read off the deltas sent."""
    h = req.delivery.history
    if isinstance(h, CompactHistory) and h.terminal is not None:
        return replace(h.terminal.usage)
    deltas = req.delivery.deltas()
    return Usage(prompt_tokens=len(req.prompt_ids), selected_tokens=len(req.output_ids),
                 processed_tokens=req.seq.processed_tokens, cached_tokens=req.seq.cached_tokens,
                 draft_tokens=req.draft_tokens, accepted_draft_tokens=req.accepted_draft_tokens,
                 # the prediction's own drafts (off it, a request drafts from its own tokens too)
                 accepted_prediction_tokens=req.prediction.accepted if req.prediction else 0,
                 rejected_prediction_tokens=req.prediction.drafted - req.prediction.accepted if req.prediction else 0,
                 returned_tokens=sum(len(d.token_ids) for d in deltas),
                 returned_bytes=sum(len(d.text.encode()) for d in deltas))


def output(req: Request) -> RequestOutput:
    """The request's result as it stands: text, ids and logprobs as the deltas carried them."""
    rec, p = req.delivery, req.params
    logprobs = top = None
    if isinstance(rec.history, CompactHistory):         # an ended request: read the packed arrays
        h = rec.history
        text, ids = h.text, h.token_ids
        if p.logprobs is not None:
            logprobs = h.logprobs or []
        if p.logprobs:
            top = h.top_logprobs or []
    else:
        deltas = rec.deltas()
        text, ids = "".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids]
        if p.logprobs is not None:
            logprobs = [lp for d in deltas for lp in (d.logprobs or ())]
        if p.logprobs:
            top = [t for d in deltas for t in (d.top_logprobs or ())]
    timings = replace(req.timings, send_s=rec.send_s)
    return RequestOutput(
        request_id=req.request_id, prompt_token_ids=list(req.prompt_ids), token_ids=ids, text=text,
        state=req.state, finish_reason=req.finish_reason, stop_reason=req.stop_reason, usage=usage(req),
        error=req.error, selected_token_ids=list(req.output_ids), logprobs=logprobs, top_logprobs=top,
        timings=timings,
        prompt_logprobs=None if p.prompt_logprobs is None else list(req.prompt_lps),
        prompt_top_logprobs=list(req.prompt_tops) if p.prompt_logprobs else None)


class Delivery:
    def __init__(self, requests: RequestRegistry, lock: threading.RLock, config: EngineConfig,
                 wake: Callable[[], None]) -> None:
        self.requests = requests
        self._lock = lock
        self._wake = wake
        self.max_events = config.stream_max_events
        self.max_bytes = config.stream_max_bytes

    # -- the engine's side (its lock held): events out ------------------------------------------
    @staticmethod
    def open(req: Request, acked: bool, attachment: Attachment | None) -> None:
        """A new request: acked=True gives it an ack cursor (its consumer holds it back)."""
        req.delivery.cursor = -1 if acked else None
        req.delivery.attachment = attachment

    def start(self, req: Request, model: str, events: list[Event]) -> None:
        self._emit(req, StartEvent(req.request_id, 0, model), events)

    def deliver(self, req: Request, em: Emission, events: list[Event]) -> None:
        """A delta of what the output pipeline released (nothing when it released nothing)."""
        if not (em.text or em.token_ids):
            return
        p = req.params
        lps = em.logprobs if p.logprobs is not None else None
        top = em.top_logprobs if p.logprobs else None
        ev = DeltaEvent(req.request_id, len(req.delivery.history), em.text, em.token_ids, lps, top)
        if req.trace.tokens and req.pipeline is not None:
            req.trace.token("delta", seq=ev.seq, bytes=len(em.text.encode()), tokens=len(em.token_ids),
                            held_chars=req.pipeline.held_chars, held_ids=req.pipeline.stop_ids.held)
        self._emit(req, ev, events)

    def terminal(self, req: Request, state: RequestState, reason: FinishReason, error: str | None,
                 events: list[Event]) -> None:
        """The terminal event, the last: the history is kept compactly from here."""
        self._emit(req, TerminalEvent(req.request_id, len(req.delivery.history), state, reason, usage(req),
                                      error, req.stop_reason), events)
        req.delivery.history = CompactHistory(req.delivery.history)   # type: ignore[arg-type]

    def _emit(self, req: Request, ev: Event, events: list[Event]) -> None:
        rec = req.delivery
        assert isinstance(rec.history, list) and ev.seq == len(rec.history), "seq n is history[n]"
        rec.history.append(ev)
        events.append(ev)
        if rec.cursor is not None:
            rec.unacked_at.append(time.perf_counter())

    def held_back(self, req: Request) -> bool:
        """True while the request's consumer has too much unacked (it then waits, its step state
        untouched); records when a pause starts and ends."""
        rec = req.delivery
        if rec.cursor is not None:
            unacked = rec.newest - rec.cursor
            if unacked >= self.max_events or (unacked and self._unacked_bytes(rec) >= self.max_bytes):
                if rec.paused_since is None:
                    rec.paused_since = time.perf_counter()
                    req.trace.add("backpressure.paused", unread=unacked)
                return True
        if rec.paused_since is not None:
            rec.paused_since = None
            req.trace.add("backpressure.resumed")
        return False

    @staticmethod
    def _unacked_bytes(rec: DeliveryRecord) -> int:
        assert rec.cursor is not None and isinstance(rec.history, list)
        return sum(len(e.text.encode()) for e in rec.history[rec.cursor + 1:] if isinstance(e, DeltaEvent))

    # -- the consumer's side (any thread) -------------------------------------------------------
    def replay(self, request_id: str, after_seq: int = -1) -> list[Event]:
        """Every event of the request with seq > after_seq, in order (for a reconnecting client).
        A request forgotten to bound memory raises ForgottenRequestError (a KeyError) saying so;
        after_seq beyond the request's newest event raises ValueError (no client has seen it)."""
        with self._lock:
            return self._after(self.requests.get(request_id), after_seq)

    @staticmethod
    def _after(req: Request, after_seq: int) -> list[Event]:
        rec = req.delivery
        if after_seq > rec.newest:
            raise ValueError(f"after_seq {after_seq} is beyond request {req.request_id!r}'s newest event "
                             f"({rec.newest})")
        if isinstance(rec.history, list):          # live: seq n is history[n]
            return rec.history[max(after_seq + 1, 0):]
        return [e for e in rec.history if e.seq > after_seq]

    def newest_event(self, request_id: str) -> tuple[int, bool]:
        """The seq of the request's newest event, and whether that is its terminal event."""
        with self._lock:
            req = self.requests.get(request_id)
            return req.delivery.newest, req.state.terminal

    def ack(self, request_id: str, seq: int) -> None:
        """The consumer of an acked request has taken every event up to seq (backpressure lifts).
        An older ack, or one of a request without an ack cursor, changes nothing; an ack past
        the newest event counts up to the newest (no consumer has taken more)."""
        with self._lock:
            req = self.requests.live.get(request_id)
            was_paused = req is not None and req.delivery.paused_since is not None
            if req is not None:
                self._advance(req.delivery, seq)
        if was_paused:
            self._wake()

    @staticmethod
    def _advance(rec: DeliveryRecord, seq: int) -> None:
        if rec.cursor is None or seq <= rec.cursor:
            return
        seq = min(seq, rec.newest)
        now = time.perf_counter()
        for _ in range(seq - rec.cursor):
            if rec.unacked_at:
                rec.send_s += now - rec.unacked_at.popleft()
        rec.cursor = seq

    def read_events(self, request_id: str, max_events: int | None = None) -> list[Event]:
        """For a caller that steps the engine itself: the events of an acked request past its
        ack cursor (at most max_events), acked as they are returned, so backpressure lifts."""
        with self._lock:
            req = self.requests.get(request_id)
            rec = req.delivery
            if rec.cursor is None:
                raise ValueError(f"request {request_id!r} has no ack cursor: add it with acked=True "
                                 "(or read its history with replay)")
            events = self._after(req, rec.cursor)[:max_events]
            was_paused = rec.paused_since is not None and not req.state.terminal
            if events:
                self._advance(rec, events[-1].seq)
        if was_paused and events:
            self._wake()
        return events

    def detach(self, request_id: str) -> None:
        """The consumer left but the request goes on: nothing holds it back any more (its events
        stay in the history for replay)."""
        with self._lock:
            rec = self.requests.get(request_id).delivery
            rec.cursor = rec.paused_since = None
            rec.unacked_at.clear()
        self._wake()

    def result(self, request_id: str) -> RequestOutput:
        with self._lock:
            return output(self.requests.get(request_id))

    def trace(self, request_id: str) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.requests.get(request_id).trace.records)

    def pin(self, request_id: str) -> None:
        """Keep the request's result, events and trace readable, past max_finished_kept /
        max_finished_bytes, until `unpin`: for a consumer that has yet to receive them. Raises
        KeyError (ForgottenRequestError) when they are already gone."""
        with self._lock:
            self.requests.pin(request_id)

    def unpin(self, request_id: str) -> None:
        """Release one pin; once none is left a finished request may be forgotten again."""
        with self._lock:
            self.requests.unpin(request_id)

    def forget(self, request_id: str) -> None:
        """Drop a terminal request's stored result and history."""
        with self._lock:
            self.requests.forget(request_id)
