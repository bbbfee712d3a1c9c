"""A request's bounded outgoing buffer. The engine stops scheduling a request whose buffer is
full (backpressure); a consumer draining it lets the request run again."""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

from .events import DeltaEvent, Event


class EventBuffer:
    def __init__(self, max_events: int, max_bytes: int) -> None:
        self.max_events = max_events
        self.max_bytes = max_bytes
        self._items: deque[tuple[float, Event]] = deque()
        self._bytes = 0
        self._lock = threading.Lock()
        self.on_push: Callable[[], None] | None = None     # set by AsyncEngine.submit: wake its stream
        self.on_pop: Callable[[], None] | None = None
        self.wait_s = 0.0               # summed time events sat here before being read

    def __len__(self) -> int:
        return len(self._items)

    @property
    def full(self) -> bool:
        return len(self._items) >= self.max_events or self._bytes >= self.max_bytes

    def push(self, event: Event) -> None:
        """Never refuses: the engine checks `full` before scheduling, so the overshoot is at most
        one step's events (a delta, a flush and the terminal event)."""
        size = len(event.text.encode()) if isinstance(event, DeltaEvent) else 0
        with self._lock:
            self._items.append((time.perf_counter(), event))
            self._bytes += size
        if self.on_push is not None:
            self.on_push()

    def pop(self, max_events: int | None = None) -> list[Event]:
        out: list[Event] = []
        now = time.perf_counter()
        with self._lock:
            was_full = self.full
            while self._items and (max_events is None or len(out) < max_events):
                t, ev = self._items.popleft()
                self.wait_s += now - t
                if isinstance(ev, DeltaEvent):
                    self._bytes -= len(ev.text.encode())
                out.append(ev)
        if out and was_full and self.on_pop is not None:     # only a full buffer held its request back
            self.on_pop()
        return out
