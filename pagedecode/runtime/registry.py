"""The request registry: live requests by id, and the finished ones kept readable (result,
replay, trace) within a count and a byte budget, the oldest forgotten first. A pinned request
(a consumer has yet to receive it) is never forgotten: eviction passes over it, and takes it
once its last pin is released."""
from __future__ import annotations

import secrets
from collections import OrderedDict
from typing import TYPE_CHECKING

from ..errors import ForgottenRequestError, InvalidRequestError, UnknownRequestError

if TYPE_CHECKING:
    from .request import Request

FORGOTTEN_IDS_KEPT = 100_000      # ids of forgotten requests, so a lookup can say what happened


class RequestRegistry:
    def __init__(self, max_finished: int, max_finished_bytes: int | None, id_prefix: str = "req-") -> None:
        self.id_prefix = id_prefix
        self.max_finished = max_finished
        self.max_finished_bytes = max_finished_bytes
        self.live: dict[str, Request] = {}
        self._finished: OrderedDict[str, tuple[Request, int]] = OrderedDict()   # oldest first
        self._finished_bytes = 0
        self._forgotten: OrderedDict[str, None] = OrderedDict()
        self._pins: dict[str, int] = {}      # request id -> consumers yet to read it (never 0)

    @property
    def finished_bytes(self) -> int:
        return self._finished_bytes

    @property
    def num_finished(self) -> int:
        return len(self._finished)

    def new_id(self) -> str:
        """`req-` (id_prefix) and 128 random bits: nobody can guess another client's id (the server's
        events and trace routes are reached by id), and none a live or kept request has."""
        while True:
            rid = f"{self.id_prefix}{secrets.token_hex(16)}"
            if rid not in self.live and rid not in self._finished:
                return rid

    def add(self, req: Request) -> None:
        if req.request_id in self.live:
            raise InvalidRequestError(f"request id {req.request_id!r} is still live")
        self._drop(req.request_id)             # reuse once the earlier one is terminal
        self._forgotten.pop(req.request_id, None)
        self._pins.pop(req.request_id, None)
        self.live[req.request_id] = req

    def finish(self, req: Request) -> None:
        """A request became terminal: keep it readable within the budgets."""
        self.live.pop(req.request_id, None)
        size = req.kept_bytes()
        self._finished[req.request_id] = (req, size)
        self._finished_bytes += size
        self._evict()

    def _evict(self) -> None:
        """Forget the oldest unpinned finished requests until both budgets hold (the byte budget
        keeps at least one). Walks past pinned ones only: pins are held by attached consumers."""
        excess = len(self._finished) - self.max_finished
        budget = self.max_finished_bytes
        excess_bytes = 0 if budget is None else self._finished_bytes - budget
        victims: list[str] = []
        for rid, (req, size) in self._finished.items():
            over_bytes = excess_bytes > 0 and len(self._finished) - len(victims) > 1
            if excess <= 0 and not over_bytes:
                break
            if rid in self._pins:
                continue
            victims.append(rid)
            excess -= 1
            excess_bytes -= size
        for rid in victims:
            self._drop(rid)
            self._forgotten[rid] = None
        while len(self._forgotten) > FORGOTTEN_IDS_KEPT:
            self._forgotten.popitem(last=False)

    def pin(self, rid: str) -> None:
        """Keep the request readable until unpin (live or kept; UnknownRequestError, a KeyError,
        when it is not)."""
        self.get(rid)
        self._pins[rid] = self._pins.get(rid, 0) + 1

    def unpin(self, rid: str) -> None:
        left = self._pins.get(rid, 0) - 1
        if left < 0:
            return
        if left:
            self._pins[rid] = left
            return
        del self._pins[rid]
        if rid in self._finished:
            self._evict()

    def _drop(self, rid: str) -> None:
        entry = self._finished.pop(rid, None)
        if entry is not None:
            self._finished_bytes -= entry[1]

    def forget(self, rid: str) -> None:
        if rid in self._finished:
            self._drop(rid)
            self._pins.pop(rid, None)

    def get(self, rid: str) -> Request:
        req = self.live.get(rid)
        if req is not None:
            return req
        entry = self._finished.get(rid)
        if entry is not None:
            return entry[0]
        if rid in self._forgotten:
            raise ForgottenRequestError(f"request {rid!r} finished and was forgotten to bound memory "
                                        "(max_finished_kept / max_finished_bytes): its result, events "
                                        "and trace are no longer kept")
        raise UnknownRequestError(f"unknown request id {rid!r}")
