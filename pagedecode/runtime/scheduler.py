"""Continuous batching: who computes how many tokens this step, and who gives up pages.

Order each step: running requests with one token to decode, oldest first; then running
requests still prefilling (chunked under the token budget); then admission from the queue
while slots, pages and budget last. When a running request needs a page and none is free,
the most recently admitted request not yet scheduled this step is preempted: pages and slot
released, back to the front of the queue, its step state untouched (it recomputes later).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from .lifecycle import RequestState
from .page_pool import PagePool
from .request import Request
from .slots import SlotTable


@dataclass
class ScheduledSeq:
    request: Request
    num_new: int          # tokens computed this step: known[num_computed : num_computed + num_new]
    samples: bool         # the chunk reaches the last known token: its logits choose the next one


@dataclass
class SchedulerOutput:
    decode: list[ScheduledSeq] = field(default_factory=list)    # num_new == 1, sampling
    prefill: list[ScheduledSeq] = field(default_factory=list)   # prompt chunks and recomputes
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill

    @property
    def seqs(self) -> list[ScheduledSeq]:
        return self.decode + self.prefill


class Scheduler:
    def __init__(self, pool: PagePool, slots: SlotTable, page_size: int, max_tokens_per_step: int,
                 on_release_pages: Callable[[Request], None]) -> None:
        self.pool = pool
        self.slots = slots
        self.page_size = page_size
        self.max_tokens_per_step = max_tokens_per_step
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._release_pages = on_release_pages
        self._admissions = 0

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Forget a request that ended (its resources are released by the engine)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def schedule(self, runnable: Callable[[Request], bool]) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_tokens_per_step
        scheduled: set[int] = set()
        by_age = sorted(self.running, key=lambda r: r.admitted_order)
        decoding = [r for r in by_age if r.num_tokens - r.num_computed == 1]
        chunking = [r for r in by_age if r.num_tokens - r.num_computed > 1]
        for req in decoding + chunking:
            if budget == 0:
                break
            if req not in self.running or not runnable(req):
                continue
            n = min(req.num_tokens - req.num_computed, budget)
            if not self._grow(req, n, scheduled, out):
                continue
            scheduled.add(id(req))
            budget -= n
            seq = ScheduledSeq(req, n, req.num_computed + n == req.num_tokens)
            (out.decode if req in decoding else out.prefill).append(seq)
        while self.waiting and budget > 0 and self.slots.free_slots:
            req = self.waiting[0]
            if not runnable(req):
                break
            n = min(req.num_tokens - req.num_computed, budget)
            pages = self.pool.allocate(self.pages_for(req.num_computed + n) - len(req.pages))
            if pages is None:
                break                      # head of line waits for pages; nothing is preempted
            self.waiting.popleft()
            req.pages.extend(pages)
            req.slot = self.slots.acquire()
            req.admitted_order = self._admissions
            self._admissions += 1
            self.running.append(req)
            if req.state == RequestState.QUEUED:
                req.transition(RequestState.PREFILLING)
            out.admitted.append(req)
            scheduled.add(id(req))
            budget -= n
            out.prefill.append(ScheduledSeq(req, n, req.num_computed + n == req.num_tokens))
        return out

    def _grow(self, req: Request, n: int, scheduled: set[int], out: SchedulerOutput) -> bool:
        """Give req the pages for n more tokens, preempting the newest others if needed.
        False when req itself had to be preempted."""
        need = self.pages_for(req.num_computed + n) - len(req.pages)
        while need > 0:
            pages = self.pool.allocate(need)
            if pages is not None:
                req.pages.extend(pages)
                return True
            victims = [r for r in self.running if id(r) not in scheduled]
            victim = max(victims, key=lambda r: r.admitted_order)
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        return True

    def preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release_pages(req)
        req.num_computed = 0
        assert req.slot is not None, "a running request holds a slot"
        self.slots.release(req.slot)
        req.slot = None
        req.trace.add("preempted", output_tokens=len(req.output_ids))
        self.waiting.appendleft(req)
