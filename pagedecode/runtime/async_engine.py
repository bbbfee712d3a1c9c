"""AsyncEngine: the step loop in a background thread; each request an async stream of events.

One delivery path (runtime/output/delivery.py): every reader reads a request's history after its own
cursor. `submit` returns a RequestStream that does so and acks what it takes (the request is
added with acked=True), so a slow reader pauses only its own request (backpressure);
`follow` reads without acking (for a reconnecting client, or a server that acks what it sent).
Each reader arms its own future before it looks at the history, and the step thread resolves
the futures of every request a step gave events to, so no reader can miss a wake-up.

A stream closed or dropped before its terminal event cancels the request as transport_error
(on_disconnect="cancel", the default) or lets it run to the end unread ("continue"); so does a
stream whose pending `__anext__` is cancelled (as an async generator's is) or whose iterating
task ends cancelled, and leaving `async with stream:`. Leaving the AsyncEngine's `async with`
block ends every live request exactly once.
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

from ..lora.request import LoRARequest
from ..params import SamplingParams
from .engine import Engine
from .output.events import Event, TerminalEvent
from .lifecycle import FinishReason

log = logging.getLogger("pagedecode")
DISCONNECT_POLICIES = ("cancel", "continue")


class RequestStream:
    """A submitted request's events: read from its history after this stream's cursor, each
    batch acked as it is taken. Holds a pin on the request until it ends or is closed, so the
    events are there to read however long the reader takes."""

    def __init__(self, owner: "AsyncEngine", request_id: str) -> None:
        self._owner = owner
        self.request_id = request_id
        self._cursor = -1            # the seq of the last event taken (and acked)
        self._pending: deque[Event] = deque()
        self.done = False
        self._closed = False
        self._task: weakref.ref[asyncio.Task[object]] | None = None   # the task reading it, watched

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._disconnect()

    def _watch_task(self) -> None:
        """A task that ends cancelled while reading this stream closes it at once (its traceback
        would otherwise keep the stream, and the request paused, until the task is collected)."""
        task = asyncio.current_task()
        if task is None or (self._task is not None and self._task() is task):
            return
        self._task = weakref.ref(task)
        ref = weakref.ref(self)

        def done(t: asyncio.Task[object]) -> None:
            stream = ref()
            if stream is not None and t.cancelled():
                stream._disconnect()
        task.add_done_callback(done)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> Event:
        self._watch_task()
        while not self._pending:
            if self.done or self._closed:
                raise StopAsyncIteration
            try:
                events = await self._owner._events_after(self.request_id, self._cursor)
            except asyncio.CancelledError:       # as an async generator's: the stream ends
                self._disconnect()
                raise
            self._cursor = events[-1].seq
            self._owner.engine.ack(self.request_id, self._cursor)
            self._pending.extend(events)
        event = self._pending.popleft()
        if isinstance(event, TerminalEvent):
            self._end()
        return event

    async def cancel(self) -> bool:
        """The user's cancel: the request ends CANCELLED with finish reason cancelled."""
        return self._owner.engine.cancel(self.request_id)

    async def aclose(self) -> None:
        """The consumer goes away before the end: a transport matter, per on_disconnect."""
        self._disconnect()

    def _end(self) -> None:
        """The terminal event is taken: the reader needs the request no more."""
        if not self.done:
            self.done = True
            self._owner.engine.unpin(self.request_id)

    def _disconnect(self) -> None:
        if self.done or self._closed:
            return
        self._closed = True
        engine = self._owner.engine
        if self._owner.on_disconnect == "cancel":
            engine.cancel(self.request_id, reason=FinishReason.TRANSPORT_ERROR)
        else:
            engine.detach_stream(self.request_id)
        engine.unpin(self.request_id)

    def __del__(self) -> None:
        try:
            self._disconnect()
        except Exception:   # never raise from a finalizer
            pass


class AsyncEngine:
    def __init__(self, engine: Engine, on_disconnect: str = "cancel", idle_wait_s: float = 0.05,
                 leave_core_for_loop: bool = False, stream_interval_s: float = 0.001) -> None:
        """leave_core_for_loop: on a CPU engine, run torch with one intra-op thread fewer while
        this AsyncEngine runs (restored at shutdown), so the event loop never preempts a forward's
        thread. Off by default: the compiled forward's workers sleep ~2 ms after their work, so the
        loop's events find a core between steps, and a core given up is a core the forward lacks.
        On 2 cores (benchmarks/async_vs_engine.py --leave-core, 2026-12-07) SmolLM2-135M's Q4_1
        file streamed at 0.72x Engine.generate with it and 0.95x without, over HTTP 0.61-0.66x
        and 0.86-0.92x; the tiny default model 0.83x / 0.82x either way. (It was on by default
        when torch's OpenMP workers, spinning between ops, made a stream 2.6x slower.)
        stream_interval_s: streams and followers are woken at most this often (and always when
        the engine goes idle). Each wake costs the step thread two GIL hand-offs; on a model whose steps
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
        # request id -> the futures its readers (streams and followers) wait on, one per reader;
        # changed on the loop thread only
        self._followers: dict[str, set[asyncio.Future[None]]] = {}
        self._due: set[str] = set()     # step thread: followed requests with events not yet woken for
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
            self.engine.process.set_threads(self._saved_threads - 1)
        self.engine.wakeup = self._work.set
        self._thread = threading.Thread(target=self._run, name="pagedecode-steps", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._saved_threads is not None:      # OpenMP's thread count is per thread: set it here too
            self.engine.process.set_threads(self._saved_threads - 1)
        engine = self.engine
        while not self._stopping.is_set():
            if not engine.has_unfinished():
                self._work.wait(self.idle_wait_s)
                self._work.clear()
                continue
            steps = engine.steps
            try:
                events = engine.step()
            except Exception:
                log.exception("engine step failed")
                events = None
            idle = engine.steps == steps        # nothing ran: all waiting or paused
            self._wake_followers(events, force=idle or not engine.has_unfinished())
            if idle:                            # sleep until work arrives
                self._work.wait(self.idle_wait_s)
                self._work.clear()

    def _wake_followers(self, events: list[Event] | None, force: bool) -> None:
        """On the step thread: wake the readers of every request these events belong to (None:
        the step failed, wake them all), in one hop to the loop at most every stream_interval_s
        (each hop costs the step thread two GIL hand-offs). A reader arms its future before it
        reads the history, so events it did not see always come with a wake-up."""
        followed = self._followers
        if self._loop is None:
            return
        if events is None:
            self._due.update(followed)
        elif followed:
            self._due.update(ev.request_id for ev in events if ev.request_id in followed)
        if not self._due:
            return
        now = time.perf_counter()
        if not force and now - self._last_wake < self.stream_interval_s:
            return
        self._last_wake = now
        rids, self._due = self._due, set()
        self._loop.call_soon_threadsafe(self._resolve_followers, rids)

    def _resolve_followers(self, rids: set[str] | None = None) -> None:
        """On the loop: resolve the futures waiting on these requests (None: all of them)."""
        for rid in list(self._followers) if rids is None else rids:
            for waiter in self._followers.pop(rid, ()):
                if not waiter.done():
                    waiter.set_result(None)

    def _unfollow(self, request_id: str, waiter: asyncio.Future[None]) -> None:
        waiters = self._followers.get(request_id)
        if waiters is not None:
            waiters.discard(waiter)
            if not waiters:
                del self._followers[request_id]

    def submit(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
               lora: LoRARequest | None = None) -> RequestStream:
        """Queue a request (under the LoRA adapter `lora`, if given); its events arrive through
        the returned async iterator, which acks what it takes (backpressure). Raises
        InvalidRequestError at once for a request that can never be served."""
        if self._thread is None:
            raise RuntimeError("AsyncEngine is not running: use `async with AsyncEngine(engine)`")
        if self._stopping.is_set():
            raise RuntimeError("AsyncEngine is shutting down")
        rid = self.engine.add_request(prompt, params, request_id, acked=True, pinned=True, lora=lora)
        return RequestStream(self, rid)

    async def _events_after(self, request_id: str, after_seq: int) -> list[Event]:
        """The request's events with seq > after_seq, waiting until there is at least one: this
        caller's own future is armed before it looks, so a step's events always wake it."""
        loop = asyncio.get_running_loop()
        while True:
            waiter: asyncio.Future[None] = loop.create_future()
            self._followers.setdefault(request_id, set()).add(waiter)    # arm, then look
            try:
                events = self.engine.replay(request_id, after_seq)
                if events:
                    return events
                await waiter
            finally:
                self._unfollow(request_id, waiter)

    async def follow(self, request_id: str, after_seq: int = -1) -> AsyncIterator[Event]:
        """Every event of a request with seq > after_seq, then its live events until the terminal
        one: for a client that reconnects (dedupe by (request id, seq)). after_seq equal to the
        terminal event's seq (a client that has seen everything) ends at once. Raises ValueError
        when after_seq is beyond the request's newest event, KeyError for an unknown or forgotten
        request. Acks nothing: a consumer that holds the request back acks what it sent."""
        newest, ended = self.engine.newest_event(request_id)
        if after_seq > newest:
            raise ValueError(f"after_seq {after_seq} is beyond request {request_id!r}'s newest event ({newest})")
        if ended and after_seq == newest:
            return
        while True:
            for ev in await self._events_after(request_id, after_seq):
                yield ev
                after_seq = ev.seq
                if isinstance(ev, TerminalEvent):
                    return

    @property
    def running(self) -> bool:
        return self._thread is not None and not self._stopping.is_set()

    async def shutdown(self) -> None:
        """Stop the step loop, then end every live request exactly once (cancelled)."""
        self._stopping.set()
        self._work.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self.engine.end_all()
        self._resolve_followers()          # their terminal events are in the history now
        self.engine.wakeup = None
        if self._saved_threads is not None:
            self.engine.process.set_threads(self._saved_threads)
            self._saved_threads = None
