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
import weakref
from collections import deque

from ..params import SamplingParams
from .engine import Engine
from .events import Event, TerminalEvent
from .lifecycle import FinishReason

log = logging.getLogger("pagedecode")
DISCONNECT_POLICIES = ("cancel", "continue")


class RequestStream:
    def __init__(self, owner: "AsyncEngine", request_id: str, buffer) -> None:
        self._owner = owner
        self.request_id = request_id
        self._buffer = buffer
        self._ready = asyncio.Event()
        self._pending: deque[Event] = deque()
        self.done = False
        self._closed = False

    def _notify(self) -> None:
        self._ready.set()

    def __aiter__(self):
        return self

    async def __anext__(self) -> Event:
        while not self._pending:
            if self.done or self._closed:
                raise StopAsyncIteration
            self._ready.clear()
            events = self._buffer.pop()
            if events:
                self._pending.extend(events)
                break
            await self._ready.wait()
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


class AsyncEngine:
    def __init__(self, engine: Engine, on_disconnect: str = "cancel", idle_wait_s: float = 0.05) -> None:
        if on_disconnect not in DISCONNECT_POLICIES:
            raise ValueError(f"on_disconnect must be one of {DISCONNECT_POLICIES}, got {on_disconnect!r}")
        self.engine = engine
        self.on_disconnect = on_disconnect
        self.idle_wait_s = idle_wait_s
        self._work = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def __aenter__(self) -> "AsyncEngine":
        self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.engine.wakeup = self._work.set
        self._thread = threading.Thread(target=self._run, name="pagedecode-steps", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping.is_set():
            if not self.engine.has_unfinished():
                self._work.wait(self.idle_wait_s)
                self._work.clear()
                continue
            try:
                events = self.engine.step()
            except Exception:
                log.exception("engine step failed")
                events = []
            if not events:           # everything paused or waiting: sleep until work arrives
                self._work.wait(self.idle_wait_s)
                self._work.clear()

    def submit(self, prompt, params: SamplingParams | None = None, request_id: str | None = None
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

        def wake() -> None:
            live = ref()
            if live is not None:
                loop.call_soon_threadsafe(live._notify)
        buffer.on_push = wake
        stream._notify()
        return stream

    async def shutdown(self) -> None:
        """Stop the step loop, then end every live request exactly once (cancelled)."""
        self._stopping.set()
        self._work.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self.engine.shutdown()
        self.engine.wakeup = None
