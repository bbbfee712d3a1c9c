"""The Reader: what one HTTP exchange holds of the requests it answers, written once.

    held     a pin on each request, so its result and events stay readable until it is sent:
             the one engine.add_request(pinned=True) took when admission started it, or one
             taken here (Reader.pinning) for a retry or a resumed stream;
    enter    `async with reader`: each request has one more client reading it (a disconnect's
             grace period, if one runs, is over);
    read     events (one request, after a cursor), merged (several, tagged with their index) or
             wait_all (to their ends, for one body): each event is seen (first token, inter-token
             latency; the terminal event meters the request) and acked once the caller comes back
             for the next, i.e. has sent it (backpressure lifts);
    exit     on every path (the end, the client gone, a cancellation, the server's drain): one
             client fewer; each request whose terminal event this reader did not see gets its
             disconnect policy (cancel, now or after resume_grace_s, or continue) and a watcher
             that meters it when it ends; then every pin is released, once.

A reader that is never entered (a handler that answers without reading) releases its pins with
release(). Every request is metered exactly once (Track.metered), when its terminal event is
first seen, by a reader or by the watcher that follows a request nobody reads.
"""
from __future__ import annotations

import asyncio
import time
from typing import AsyncGenerator, AsyncIterator, Callable

from starlette.requests import Request

from ..errors import UnknownRequestError
from ..runtime.output.events import DeltaEvent, Event, TerminalEvent
from ..runtime.lifecycle import FinishReason
from ..runtime.output.result import RequestOutput
from .errors import ApiError
from .metering import log_record, observe
from .state import ServerState
from .tracks import Track


def served_name(state: ServerState, track: Track) -> str:
    """The `model` a response names: the adapter the request asked for, else the served model."""
    return track.adapter if track.adapter is not None else state.options.model_name


class Reader:
    def __init__(self, state: ServerState, tracks: list[Track]) -> None:
        """The reader of `tracks`, holding one pin on each (the caller's, handed over)."""
        self.state, self.engine, self.tracks = state, state.engine, tracks
        self.model_name = served_name(state, tracks[0]) if tracks else state.options.model_name
        self.tokenizer = state.engine.tokenizer
        self._ended: set[str] = set()         # requests whose terminal event this reader saw
        self._held = True

    @classmethod
    def pinning(cls, state: ServerState, tracks: list[Track],
                gone: Callable[[UnknownRequestError], ApiError]) -> Reader:
        """A reader with a pin of its own on each request; `gone` is the answer for one the engine
        no longer keeps (the pins taken before it are released)."""
        for i, track in enumerate(tracks):
            try:
                state.engine.pin(track.request_id)
            except UnknownRequestError as e:
                for held in tracks[:i]:
                    state.engine.unpin(held.request_id)
                raise gone(e) from None
        return cls(state, tracks)

    def release(self) -> None:
        """Every pin this reader holds, once."""
        if self._held:
            self._held = False
            for track in self.tracks:
                self.engine.unpin(track.request_id)

    def result(self, track: Track) -> RequestOutput:
        return self.engine.result(track.request_id)

    def history(self, track: Track) -> list[Event]:
        """The request's events so far (what a resumed client may already have)."""
        return self.engine.replay(track.request_id, -1)

    def let_run(self, track: Track) -> None:
        """Nobody has to read the request for it to run on (a background response): its stream
        holds it back no more, and a watcher meters it when it ends."""
        self.engine.detach_stream(track.request_id)
        watch(self.state, track)

    async def __aenter__(self) -> Reader:
        for track in self.tracks:
            track.attach()
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            for track in self.tracks:
                track.detach()
            for track in self.tracks:
                if track.request_id not in self._ended:
                    self._gone(track)
        finally:
            self.release()

    # -- reading ----------------------------------------------------------------------------------
    async def events(self, track: Track, after_seq: int = -1) -> AsyncIterator[Event]:
        """The request's events after after_seq (what the client already has: acked now), live to
        its terminal event; none when the client already has that."""
        rid = track.request_id
        newest, ended = self.engine.newest_event(rid)
        if after_seq >= 0:
            self.engine.ack(rid, after_seq)
        if ended and after_seq >= newest:
            self._ended.add(rid)
            return
        async for ev in self.state.async_engine.follow(rid, after_seq):
            self._seen(track, ev)
            yield ev
            self.engine.ack(rid, ev.seq)          # sent: the request may run on (backpressure)

    async def merged(self) -> AsyncGenerator[tuple[int, Event], None]:
        """Every request's events as they come, each tagged with the request's index."""
        queue: asyncio.Queue[tuple[int, Event | None]] = asyncio.Queue()

        async def follow(i: int, track: Track) -> None:
            try:
                async for ev in self.state.async_engine.follow(track.request_id, -1):
                    queue.put_nowait((i, ev))
            finally:
                queue.put_nowait((i, None))      # this request has no more events
        tasks = [asyncio.ensure_future(follow(i, t)) for i, t in enumerate(self.tracks)]
        try:
            left = len(tasks)
            while left:
                i, ev = await queue.get()
                if ev is None:
                    left -= 1
                    continue
                track = self.tracks[i]
                self._seen(track, ev)
                yield i, ev
                self.engine.ack(track.request_id, ev.seq)    # sent: the request may run on
            for task in tasks:
                task.result()                    # a follower's failure is this reader's
        finally:
            for task in tasks:
                task.cancel()

    async def wait_all(self, request: Request) -> bool:
        """Follow every request to its end for a client waiting for one body; False when the
        client went away first (the requests still running then get their disconnect policy)."""
        async def collect(track: Track) -> None:
            async for _ in self.events(track):
                pass
        tasks = [asyncio.ensure_future(collect(t)) for t in self.tracks]
        try:
            while not all(t.done() for t in tasks):
                await asyncio.wait(tasks, timeout=0.1)
                if not all(t.done() for t in tasks) and await request.is_disconnected():
                    return False
        finally:
            for task in tasks:
                task.cancel()
        for task in tasks:
            task.result()                        # a follower's failure is this request's
        return True

    # -- what reading means ----------------------------------------------------------------------
    def _seen(self, track: Track, ev: Event) -> None:
        if isinstance(ev, DeltaEvent):
            t = time.perf_counter()
            if track.first_token is None:
                track.first_token = t
            elif track.last_delta is not None:
                self.state.metrics.itl.observe(t - track.last_delta)
            track.last_delta = t
        elif isinstance(ev, TerminalEvent):
            self._ended.add(track.request_id)
            meter(self.state, track)

    def _gone(self, track: Track) -> None:
        """This client went away before the request's end: unless another still reads it, its
        disconnect policy."""
        track.disconnects += 1
        if track.attached > 0:
            return
        policy = track.reply.on_disconnect or self.state.options.on_disconnect
        grace, engine = self.state.options.resume_grace_s, self.engine
        if policy != "continue" and grace <= 0:
            engine.cancel(track.request_id, reason=FinishReason.TRANSPORT_ERROR)
        elif policy != "continue":
            async def cancel_later() -> None:
                await asyncio.sleep(grace)
                if track.attached == 0:
                    engine.cancel(track.request_id, reason=FinishReason.TRANSPORT_ERROR)
            track.grace_task = asyncio.ensure_future(cancel_later())
        watch(self.state, track)


def watch(state: ServerState, track: Track) -> None:
    """Follow a request nobody reads to its end, so it is metered once. Neither a client nor a
    pin: it does not hold the request back, nor keep it past the engine's budget."""
    async def follow() -> None:
        try:
            async for ev in state.async_engine.follow(track.request_id, -1):
                if isinstance(ev, TerminalEvent):
                    meter(state, track)
        except UnknownRequestError:
            pass
    asyncio.ensure_future(follow())


def meter(state: ServerState, track: Track) -> None:
    """Count the request in the metrics and write its log line, once, when it has ended."""
    if track.metered:
        return
    try:
        out = state.engine.result(track.request_id)
    except UnknownRequestError:
        return
    if not out.state.terminal:
        return
    track.metered = True
    observe(state.metrics, track, out)
    log_record(track, out, served_name(state, track), state.options.log_text)
