"""The consumer side of the engine: reading a request's events, results and trace, acking and
detaching streams. A mixin of Engine (engine.py keeps the step and its safe point); every
method takes the engine's lock where it touches request state."""
from __future__ import annotations

import threading
from typing import Any, Callable

from .events import Event, RequestOutput
from .registry import RequestRegistry
from .request import Request


class ConsumerSide:
    requests: RequestRegistry
    _lock: threading.RLock
    wakeup: Callable[[], None] | None

    def _wake(self) -> None:
        if self.wakeup is not None:
            self.wakeup()

    def _get(self, request_id: str) -> Request:
        return self.requests.get(request_id)

    def read_events(self, request_id: str, max_events: int | None = None) -> list[Event]:
        """Take events from a streaming request's buffer (making room: backpressure lifts)."""
        req = self._get(request_id)
        if req.buffer is None:
            raise ValueError(f"request {request_id!r} was not added with stream=True")
        return req.buffer.pop(max_events)

    def detach_stream(self, request_id: str) -> None:
        """The consumer left but the request goes on: stop buffering its events (they stay in
        its history for replay), so backpressure no longer holds it."""
        with self._lock:
            req = self._get(request_id)
            if req.buffer is not None or req.acked_seq is not None:
                req.buffer = None
                req.acked_seq = None
                req.paused_since = None
        self._wake()

    def replay(self, request_id: str, after_seq: int = -1) -> list[Event]:
        """Every event of the request with seq > after_seq, in order (for a reconnecting client).
        A request forgotten to bound memory raises ForgottenRequestError (a KeyError) saying so;
        after_seq beyond the request's newest event raises ValueError (no client has seen it)."""
        with self._lock:
            req = self._get(request_id)
            if after_seq >= req.next_seq:
                raise ValueError(f"after_seq {after_seq} is beyond request {request_id!r}'s newest event "
                                 f"({req.next_seq - 1})")
            history = req.history
            if isinstance(history, list):          # live: seq n is history[n]
                return history[max(after_seq + 1, 0):]
            return [e for e in history if e.seq > after_seq]

    def newest_event(self, request_id: str) -> tuple[int, bool]:
        """The seq of the request's newest event, and whether that is its terminal event."""
        with self._lock:
            req = self._get(request_id)
            return req.next_seq - 1, req.state.terminal

    def has_unfinished(self) -> bool:
        return bool(self.requests.live)

    def result(self, request_id: str) -> RequestOutput:
        with self._lock:
            return self._get(request_id).to_output()

    def trace(self, request_id: str) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._get(request_id).trace.records)

    def ack(self, request_id: str, seq: int) -> None:
        """The consumer of an acked request has sent every event up to seq (backpressure lifts)."""
        with self._lock:
            req = self.requests.live.get(request_id)
            if req is None or req.acked_seq is None or seq <= req.acked_seq:
                return
            was_paused = req.paused_since is not None
            req.acked_seq = seq
        if was_paused:
            self._wake()

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
