"""AsyncEngine: the step loop in a background thread; each request an async stream of events.

Events reach a stream through its request's bounded buffer, so a slow reader pauses only its
own request (backpressure). A stream closed or dropped before its terminal event cancels the
request as transport_error (on_disconnect="cancel", the default) or lets it run to the end
unread ("continue"). Leaving the `async with` block ends every live request exactly once.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections import deque
from typing import AsyncIterator

import torch

from ..params import SamplingParams
from .engine import Engine
from .events import Event, TerminalEvent
from .lifecycle import FinishReason
from .stream import EventBuffer

log = logging.getLogger("pagedecode")
DISCONNECT_POLICIES = ("cancel", "continue")


class RequestStream:
    def __init__(self, owner: "AsyncEngine", request_id: str, buffer: EventBuffer) -> None:
        self._owner = owner
        self.request_id = request_id
        self._buffer = buffer
        self._waiter: asyncio.Future[None] | None = None
        self.armed = False           # the consumer waits: the next push must wake it
        self._pending: deque[Event] = deque()
        self.done = False
        self._closed = False

    def _notify(self) -> None:
        """On the event loop: wake the consumer if it is waiting."""
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> Event:
        while not self._pending:
            if self.done or self._closed:
                raise StopAsyncIteration
            events = self._buffer.pop()
            if not events:
                # arm, then look again: a push between the two is seen here, a later one wakes us
                self._waiter = asyncio.get_running_loop().create_future()
                self.armed = True
                events = self._buffer.pop()
                if not events:
                    await self._waiter
                    continue
                self.armed = False
                self._waiter = None
            self._pending.extend(events)
        event = self._pending.popleft()
        if isinstance(event, TerminalEvent):
            self.done = True
        return event

    async def cancel(self) -> bool:
        """The user's cancel: the request ends CANCELLED with finish reason cancelled."""
        return self._owner.engine.cancel(self.request_id)

    async def aclose(self) -> None:
        """The consumer goes away before the end: a transport matter, per on_disconnect."""
        self._disconnect()

    def _disconnect(self) -> None:
        if self.done or self._closed:
            return
        self._closed = True
        engine = self._owner.engine
        if self._owner.on_disconnect == "cancel":
            engine.cancel(self.request_id, reason=FinishReason.TRANSPORT_ERROR)
        else:
            engine.detach_stream(self.request_id)

    def __del__(self) -> None:
        try:
            self._disconnect()
        except Exception:   # never raise from a finalizer
            pass


def _notify_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream._notify()


class AsyncEngine:
    def __init__(self, engine: Engine, on_disconnect: str = "cancel", idle_wait_s: float = 0.05,
                 leave_core_for_loop: bool = True, stream_interval_s: float = 0.001) -> None:
        """leave_core_for_loop: on a CPU engine, run torch with one intra-op thread fewer while
        this AsyncEngine runs (restored at shutdown). Otherwise torch's OpenMP workers spin on
        every core between ops and the event-loop thread has to preempt them for each event:
        on 2 cores that made a stream 2.6x slower than Engine.generate.
        stream_interval_s: streams are woken at most this often (and always when the engine
        goes idle). Each wake costs the step thread two GIL hand-offs; on a model whose steps
        take under a millisecond, waking every step cost ~15% of throughput. 0 wakes every step;
        the default adds at most about a millisecond (plus a step shorter than that) of latency."""
        if on_disconnect not in DISCONNECT_POLICIES:
            raise ValueError(f"on_disconnect must be one of {DISCONNECT_POLICIES}, got {on_disconnect!r}")
        self.engine = engine
        self.leave_core_for_loop = leave_core_for_loop
        self._saved_threads: int | None = None
        self.on_disconnect = on_disconnect
        self.idle_wait_s = idle_wait_s
        self._work = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._to_wake: list[RequestStream] = []    # woken once per step, in one loop callback
        self._stepped: asyncio.Event | None = None  # set after steps while someone follows a request
        self.followers = 0
        self.stream_interval_s = stream_interval_s
        self._last_wake = 0.0

    async def __aenter__(self) -> "AsyncEngine":
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.leave_core_for_loop and self.engine.device.type == "cpu" and torch.get_num_threads() > 1:
            self._saved_threads = torch.get_num_threads()
            torch.set_num_threads(self._saved_threads - 1)
        self.engine.wakeup = self._work.set
        self._thread = threading.Thread(target=self._run, name="pagedecode-steps", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._saved_threads is not None:      # OpenMP's thread count is per thread: set it here too
            torch.set_num_threads(self._saved_threads - 1)
        while not self._stopping.is_set():
            if not self.engine.has_unfinished():
                self._work.wait(self.idle_wait_s)
                self._work.clear()
                continue
            try:
                self.engine.step()
            except Exception:
                log.exception("engine step failed")
            self._wake_streams(force=self.engine.idle or not self.engine.has_unfinished())
            if self.engine.idle:     # everything paused or waiting: sleep until work arrives
                self._work.wait(self.idle_wait_s)
                self._work.clear()

    def _wake_streams(self, force: bool = False) -> None:
        """One hop to the event loop for all the streams that got events, at most every
        stream_interval_s (each hop costs the step thread two GIL hand-offs)."""
        if self.followers and self._loop is not None and self._stepped is not None:
            self._loop.call_soon_threadsafe(self._stepped.set)
        if not self._to_wake or self._loop is None:
            return
        now = time.perf_counter()
        if not force and now - self._last_wake < self.stream_interval_s:
            return
        self._last_wake = now
        streams, self._to_wake = self._to_wake, []
        self._loop.call_soon_threadsafe(_notify_all, streams)

    def submit(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
               ) -> RequestStream:
        """Queue a request; its events arrive through the returned async iterator. Raises
        InvalidRequestError at once for a request that can never be served."""
        if self._thread is None:
            raise RuntimeError("AsyncEngine is not running: use `async with AsyncEngine(engine)`")
        if self._stopping.is_set():
            raise RuntimeError("AsyncEngine is shutting down")
        rid = self.engine.add_request(prompt, params, request_id, stream=True)
        buffer = self.engine._get(rid).buffer
        assert buffer is not None and self._loop is not None
        stream = RequestStream(self, rid, buffer)
        loop = self._loop
        ref = weakref.ref(stream)          # a dropped stream must be collectable (disconnect)

        step_thread = self._thread

        def wake() -> None:               # after each push
            live = ref()
            if live is not None and live.armed:
                live.armed = False
                if threading.current_thread() is step_thread:
                    self._to_wake.append(live)       # sent after the step
                else:
                    loop.call_soon_threadsafe(live._notify)
        buffer.on_push = wake
        return stream

    async def follow(self, request_id: str, after_seq: int = -1) -> AsyncIterator[Event]:
        """Every event of a request with seq > after_seq, then its live events until the terminal
        one: for a client that reconnects (dedupe by (request id, seq)). Raises KeyError for an
        unknown or forgotten request."""
        if self._stepped is None:
            self._stepped = asyncio.Event()
        self.followers += 1
        try:
            while True:
                self._stepped.clear()
                events = self.engine.replay(request_id, after_seq)
                for ev in events:
                    yield ev
                    after_seq = ev.seq
                    if isinstance(ev, TerminalEvent):
                        return
                try:
                    await asyncio.wait_for(self._stepped.wait(), timeout=self.idle_wait_s * 4)
                except asyncio.TimeoutError:
                    pass
        finally:
            self.followers -= 1

    @property
    def running(self) -> bool:
        return self._thread is not None and not self._stopping.is_set()

    async def shutdown(self) -> None:
        """Stop the step loop, then end every live request exactly once (cancelled)."""
        self._stopping.set()
        self._work.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self.engine.shutdown()
        self.engine.wakeup = None
        if self._saved_threads is not None:
            torch.set_num_threads(self._saved_threads)
            self._saved_threads = None
