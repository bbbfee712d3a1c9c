"""What `pagedecode serve` adds to uvicorn: connection hygiene and a drain-first shutdown.

Connections (uvicorn has a keep-alive timeout, but nothing bounds a client that connects and
sends nothing, trickles its headers, or trickles its body, and no cap keeps sockets under the
file-descriptor limit):

    header timeout   from connect (or a kept-alive connection's next byte) to complete headers;
                     then closed (408 first if part of a request came)
    body timeout     from complete headers to the body's last byte; then 408 and closed, and the
                     handler sees a disconnect (a body is read whole before a request is queued,
                     so a slow client never holds a model slot)
    keep-alive       uvicorn's timeout_keep_alive: idle between requests
    closed           nothing is written to a connection once it is closing (see _Transport)
    max connections  at the cap a new connection closes a connection that holds a place without
                     using it: first one whose body arrives slower than min_body_rate (measured
                     after BODY_RATE_GRACE_S; it gets a 408, and its handler a disconnect), the
                     slowest; else the connection idle the longest (no request running: waiting
                     for headers or kept alive). When every connection has a request running,
                     the new one gets a 503 (OpenAI error body, Connection: close) at once and
                     is closed
    per client       one address holds at most max_connections_per_client (default: half the
                     cap): beyond, its own slow-body or idle connection makes room, else the new
                     one gets a 429 the same way. (Clients behind one proxy share its address.)

Shutdown: see DrainingServer.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import resource
from dataclasses import dataclass
from types import FrameType
from typing import Any, Awaitable, Callable, cast

from uvicorn import config as uvicorn_config
from uvicorn import server as uvicorn_server
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_CONNECTIONS_CEILING = 2048
BACKLOG = 128        # the listen queue, and the most connections asyncio accepts before any is seen
FD_RESERVE = 64      # descriptors for the process itself (~30 after loading: model files, pipes, torch)
BODY_RATE_GRACE_S = 1.0   # a body's rate is judged only after this long (its first bytes may lag the headers)


def default_max_connections() -> int:
    """2048, or fewer so that the open connections, a batch of accepts not yet seen and the
    process's own files fit under RLIMIT_NOFILE (at 256: 64 connections)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS_CEILING
    return max(8, min(MAX_CONNECTIONS_CEILING, soft - FD_RESERVE - BACKLOG))


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = MAX_CONNECTIONS_CEILING   # open connections at once (see the module doc)
    header_timeout_s: float = 10.0                    # connect (or next request's first byte) -> headers
    body_timeout_s: float = 20.0                      # headers -> the body's last byte
    keep_alive_timeout_s: float = 5.0                 # idle between two requests on one connection
    min_body_rate: float = 1024.0                     # bytes/s: at the cap, a body slower is closed first (0: never)
    max_connections_per_client: int | None = None     # one client address's connections (None: half the cap)

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if not self.min_body_rate >= 0:
            raise ValueError(f"min_body_rate must be >= 0, got {self.min_body_rate}")
        if self.max_connections_per_client is not None and self.max_connections_per_client < 1:
            raise ValueError(f"max_connections_per_client must be >= 1, got {self.max_connections_per_client}")

    @property
    def per_client(self) -> int:
        return self.max_connections_per_client or max(1, self.max_connections // 2)
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


def _plain_response(status: str, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "server_error" if status[0] == "5" else
                                 "invalid_request_error", "param": None, "code": code}}).encode()
    head = (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode()
    return head + body


class _Transport:
    """A transport that drops writes once it is closing. When a client goes away, the failed
    send closes the transport at once but the protocol hears of it (connection_lost) only on a
    later loop iteration; a stream writes its buffered chunks meanwhile, and asyncio logs
    'socket.send() raised exception.' for each write past the fifth."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport

    def write(self, data: bytes) -> None:
        if not self._transport.is_closing():
            self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


# the order in which connections became idle (opened, or a response done): the smallest has been
# idle the longest. Not the loop's clock: uvloop's (uv_now) moves once per loop iteration, so the
# connections accepted in one iteration tied and the cap closed any of them, not the oldest
_went_idle = itertools.count()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the header and body timeouts and the connection cap."""

    limits: ConnectionLimits = ConnectionLimits()

    @classmethod
    def configured(cls, limits: ConnectionLimits) -> type["GuardedH11Protocol"]:
        return type("GuardedH11Protocol", (cls,), {"limits": limits})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._timer: asyncio.TimerHandle | None = None
        self._body_cycle: Any = None          # the request whose body the body timer is for
        self._body_started = 0.0              # loop time the body began, and its bytes since
        self._body_bytes = 0
        self._refused = False
        self.idle_since = next(_went_idle)
        super().connection_made(cast(asyncio.Transport, _Transport(transport)))
        others = [c for c in self.connections if c is not self and isinstance(c, GuardedH11Protocol)]
        address = self.client[0] if self.client else None
        mine = [c for c in others if c.client and c.client[0] == address] if address is not None else []
        share = self.limits.per_client                  # (a share of the whole cap is the cap's 503 below)
        if len(mine) >= share and share < self.limits.max_connections and not self._make_room(mine):
            self._refuse("429 Too Many Requests", f"this address has {share} connections with requests running "
                         f"(--max-connections-per-client {share}); retry later", "too_many_connections_from_client")
            return
        if len(self.connections) > self.limits.max_connections and not self._make_room(others):
            n = self.limits.max_connections
            self._refuse("503 Service Unavailable", f"the server has {n} connections with requests running "
                         f"(--max-connections {n}); retry later", "too_many_connections")
            return
        self._arm(self.limits.header_timeout_s, self._headers_late)

    def _busy(self) -> bool:
        """A request of this connection is in the app."""
        return self.cycle is not None and not self.cycle.response_complete

    def _slow_body_rate(self, now: float) -> float | None:
        """The body's bytes per second, when it has arrived for BODY_RATE_GRACE_S at less than
        min_body_rate; else None."""
        if not (self._busy() and self.cycle.more_body and self._body_cycle is self.cycle):
            return None
        elapsed = now - self._body_started
        rate = self._body_bytes / elapsed if elapsed > 0 else 0.0
        return rate if elapsed >= BODY_RATE_GRACE_S and rate < self.limits.min_body_rate else None

    def _make_room(self, candidates: list["GuardedH11Protocol"]) -> bool:
        """Close one of `candidates` that holds a place without using it: the slowest body
        below min_body_rate, else the longest idle. False when there is none."""
        now = self.loop.time()
        slow = [(rate, c) for c in candidates if (rate := c._slow_body_rate(now)) is not None]
        if slow:
            victim = min(slow, key=lambda rc: rc[0])[1]
            victim._cut_body(f"request body arriving at under {self.limits.min_body_rate:g} bytes/s "
                             "while the server is at its connection cap", "body_too_slow")
        else:
            idle = [c for c in candidates if not c._busy()]
            if not idle:
                return False
            victim = min(idle, key=lambda c: c.idle_since)
            victim.transport.close()
        self.connections.discard(victim)      # its connection_lost comes later; the count is now
        return True

    def _refuse(self, status: str, message: str, code: str) -> None:
        self._refused = True
        self.connections.discard(self)
        self.transport.write(_plain_response(status, message, code))
        # closed when its request arrives (read first, so the close is no reset that could
        # destroy the 503 before the client reads it), or after a second at the latest
        self._arm(1.0, self.transport.close)

    def _arm(self, delay: float, then: Callable[[], None]) -> None:
        self._disarm()
        self._timer = self.loop.call_later(delay, then)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def data_received(self, data: bytes) -> None:
        if self._refused:
            self.transport.close()
            return
        if not self._busy() and self._timer is None:       # a kept-alive connection's next request
            self._arm(self.limits.header_timeout_s, self._headers_late)
        if self._body_cycle is not None and self._body_cycle is self.cycle:
            self._body_bytes += len(data)
        super().data_received(data)
        self._follow_cycle()

    def on_response_complete(self) -> None:
        self.idle_since = next(_went_idle)
        super().on_response_complete()
        self._follow_cycle()                  # a pipelined request may have started

    def _follow_cycle(self) -> None:
        if not self._busy():
            return                            # still waiting for headers: the header timer runs
        if self.cycle.more_body:
            if self._body_cycle is not self.cycle:
                self._body_cycle = self.cycle
                self._body_started, self._body_bytes = self.loop.time(), 0
                self._arm(self.limits.body_timeout_s, self._body_late)
        else:
            self._disarm()

    def _headers_late(self) -> None:
        self._timer = None
        if self._busy() or self.transport.is_closing():
            return
        if self.conn.trailing_data[0]:        # part of a request came: say why it is closed
            self.transport.write(_plain_response("408 Request Timeout", f"request headers not complete within "
                                                 f"{self.limits.header_timeout_s:g} s", "header_timeout"))
        self.transport.close()

    def _body_late(self) -> None:
        self._timer = None
        cycle = self.cycle
        if cycle is None or not cycle.more_body or self.transport.is_closing():
            return
        self._cut_body(f"request body not complete within {self.limits.body_timeout_s:g} s", "body_timeout")

    def _cut_body(self, why: str, code: str) -> None:
        """408 (unless a response began) and close, while the request's body is still arriving."""
        self._disarm()
        cycle = self.cycle
        if not cycle.response_started:
            self.transport.write(_plain_response("408 Request Timeout", why, code))
        cycle.disconnected = True             # the handler's receive() answers http.disconnect
        cycle.message_event.set()
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if hasattr(self, "_timer"):
            self._disarm()
        super().connection_lost(exc)


class DrainingServer(uvicorn_server.Server):
    """uvicorn's Server, stopped by pagedecode's drain. uvicorn alone stops listening at the
    signal and, after its graceful-shutdown timeout, cancels the HTTP tasks before the app
    hears of it (every client cut off, every request logged transport_error), then re-raises the
    signal (exit -15). Here the first SIGINT / SIGTERM starts `drain` (a coroutine function
    taking a `hurry()` callable) while uvicorn still serves, so /health and new requests get
    503; uvicorn closes the connections only once every request has ended, and the process
    exits 0. A second signal ends the grace at once."""

    def __init__(self, config: uvicorn_config.Config, drain: Callable[[Callable[[], bool]], Awaitable[None]],
                 on_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self.drain, self.on_signal = drain, on_signal
        self.signals = 0
        self._drain: asyncio.Future[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # a signal handler: set flags only; the event loop acts on them in on_tick
        self.signals += 1
        self.on_signal()

    async def on_tick(self, counter: int) -> bool:
        if self.signals and self._drain is None:
            self._drain = asyncio.ensure_future(self.drain(lambda: self.signals > 1))
        if self._drain is not None and self._drain.done():
            self.should_exit = True
        return await super().on_tick(counter)

    async def startup(self, sockets: list[Any] | None = None) -> None:
        await super().startup(sockets)
        if sockets is not None and self.started:
            self._log_started_message(sockets)     # uvicorn says where it listens only when it binds
