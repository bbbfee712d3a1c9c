"""Continuous batching: who computes how many tokens this step, and who gives up pages.

The scheduler owns the pages and batch slots: it alone takes them (admission, growth) and
gives them back (preemption, and `release` when a request ends).

Order each step: running requests with one token to decode, oldest first; then running
requests still prefilling (chunked under the token budget); then admission from the queue,
in order, skipping requests that cannot run now (a paused consumer), while slots, pages and
budget last. When pages run out, a paused request (its consumer is not reading) is preempted
first; a running request that needs a page then takes it from the most recently admitted
request not yet scheduled this step. Preemption releases pages and slot and puts the request
back at the front of the queue, its step state untouched (it recomputes later).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from .lifecycle import RequestState
from .page_pool import PagePool
from .prefix_cache import match, register
from .request import Request
from .slots import SlotTable

if TYPE_CHECKING:
    import torch

    from ..lora.residency import AdapterResidency


@dataclass
class ScheduledSeq:
    request: Request
    num_new: int          # tokens computed this step: known[num_computed : num_computed + num_new]
    samples: bool         # the chunk reaches the last known token: its logits choose the next one
    drafts: tuple[int, ...] = ()   # speculation: proposed tokens computed after the last known one
    draft_probs: "torch.Tensor | None" = None   # (len(drafts), V): the distribution each draft was
                                   # sampled from (rejection rule, spec/rejection.py); None: exact match
    lookup: bool = False           # the drafts came from prompt lookup, not the request's own source
                                   # (its prediction, the draft model): spec/speculative.py's gates


@dataclass
class SchedulerOutput:
    decode: list[ScheduledSeq] = field(default_factory=list)    # num_new == 1, sampling
    prefill: list[ScheduledSeq] = field(default_factory=list)   # prompt chunks and recomputes
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    verify: list[ScheduledSeq] = field(default_factory=list)    # last token + drafts (runtime/spec/speculative.py)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill and not self.verify

    @property
    def seqs(self) -> list[ScheduledSeq]:
        return self.decode + self.prefill + self.verify

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.seqs)

    def begin(self, now: float) -> None:
        """The step is about to compute its seqs: each request's queue time ends, if this is its first."""
        for decode, seqs in ((True, self.decode + self.verify), (False, self.prefill)):
            for s in seqs:
                req = s.request
                if req.first_scheduled is None or req.trace.tokens:   # (a call per token otherwise)
                    req.scheduled(now, decode)


class Scheduler:
    def __init__(self, pool: PagePool, slots: SlotTable, page_size: int, max_tokens_per_step: int,
                 prefix_caching: bool = False, adapters: "AdapterResidency | None" = None) -> None:
        self.pool = pool
        self.adapters = adapters        # LoRA: a running request holds its adapter's slot (lora/residency.py)
        self.prefix_caching = prefix_caching
        self.cache_queries = 0          # prompt tokens looked up in the prefix cache
        self.cache_hits = 0             # ... and found there
        self.preemptions = 0            # requests sent back to the queue to free pages
        self._bad_writes: list[str] = []   # pages a step was planned to write that it must not
        self.slots = slots
        self.page_size = page_size
        self.max_tokens_per_step = max_tokens_per_step
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []          # in admission order: the last is the newest

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def advance(self, req: Request, num_new: int, drafts: int = 0) -> None:
        """A step computed num_new more of the request's tokens: their K/V are in its pages (a
        page that filled joins the prefix cache). Of them, `drafts` are speculative proposals:
        they count as computed once accepted (runtime/spec/speculative.py)."""
        req.seq.num_computed += num_new - drafts
        req.seq.processed_tokens += num_new
        self._register_full_pages(req)

    def accept_draft(self, req: Request) -> None:
        """A verified draft token was selected: its K/V, written by the step, counts as computed."""
        req.seq.num_computed += 1

    def settle(self, req: Request) -> None:
        """After a verify: key the pages its accepted tokens filled, give back the ones only
        rejected drafts used."""
        self._register_full_pages(req)
        self.trim(req)

    def _register_full_pages(self, req: Request) -> None:
        if self.prefix_caching and req.seq.num_computed // self.page_size > req.seq.pages_registered:
            register(self.pool, req, self.page_size)

    def release(self, req: Request) -> None:
        """A request ended: forget it and give back its pages and slot (none, when it holds none);
        its page keys go too (only a live request needs them)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.seq.page_keys = []
        self._give_back(req)

    def _give_back(self, req: Request) -> None:
        pages, req.seq.pages = req.seq.pages, []
        slot, req.seq.slot = req.seq.slot, None
        lora_slot, req.seq.lora_slot = req.seq.lora_slot, None
        req.seq.pages_registered = 0
        if lora_slot is not None:
            assert self.adapters is not None
            self.adapters.release(lora_slot)
        try:
            if pages:
                self.pool.release(reversed(pages))      # tail first: chain tails are evicted before heads
        finally:                              # a failing page release never keeps the slot
            if slot is not None:
                self.slots.release(slot)

    def schedule(self, runnable: Callable[[Request], bool]) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_tokens_per_step
        scheduled: set[int] = set()
        decoding: list[tuple[Request, int]] = []
        chunking: list[tuple[Request, int]] = []
        for r in self.running:
            if runnable(r):
                left = len(r.prompt_ids) + len(r.output_ids) - r.seq.num_computed
                if left == 1:
                    decoding.append((r, left))
                elif left > 1:
                    chunking.append((r, left))
        for (req, left), queue in [(d, out.decode) for d in decoding] + [(c, out.prefill) for c in chunking]:
            if budget == 0:
                break
            if req.seq.slot is None:                 # preempted earlier in this loop (running holds a slot)
                continue
            n = min(left, budget)
            if not self._grow(req, n, scheduled, out, runnable):
                continue
            scheduled.add(id(req))
            budget -= n
            queue.append(ScheduledSeq(req, n, n == left))
        self._admit(out, budget, scheduled, runnable)
        self._check_writes(out)
        if self.adapters is not None and any(s.request.seq.lora_slot is not None for s in out.seqs):
            # rows grouped by adapter (fewer, longer LoRA segments), decode rows still first
            out.decode.sort(key=_adapter_order)
            out.prefill.sort(key=_adapter_order)
        return out

    def try_extend(self, req: Request, tokens: int) -> bool:
        """Pages for `tokens` positions from num_computed on, from free pages only (a speculative
        extension never preempts anyone); False, taking nothing, when there are too few."""
        need = self.pages_for(req.seq.num_computed + tokens) - len(req.seq.pages)
        if need <= 0:
            return True
        pages = self.pool.allocate(need)
        if pages is None:
            return False
        req.seq.pages.extend(pages)
        return True

    def trim(self, req: Request) -> None:
        """Give back the pages past the ones the next step writes into (held for drafts that were
        rejected: their K/V lies beyond the logical length and is never read)."""
        keep = max(self.pages_for(req.num_tokens), req.seq.pages_registered)
        if len(req.seq.pages) > keep:
            extra, req.seq.pages = req.seq.pages[keep:], req.seq.pages[:keep]
            self.pool.release(reversed(extra))

    def _check_writes(self, out: SchedulerOutput) -> None:
        """Every page a step writes is held by exactly one request and is not a cached page
        (shared pages are full and never written). A violation is kept for check_integrity."""
        ps = self.page_size
        for s in out.seqs:
            req = s.request
            for i in range(req.seq.num_computed // ps, (req.seq.num_computed + s.num_new - 1) // ps + 1):
                page = req.seq.pages[i]
                if self.pool.ref_counts[page] != 1 or page in self.pool.page_hash:
                    self._bad_writes.append(f"{req.request_id} writes page {page} (refs "
                                            f"{self.pool.ref_counts[page]}, cached {page in self.pool.page_hash})")

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        if self._bad_writes:
            raise AssertionError("; ".join(self._bad_writes[:4]))

    def _admit(self, out: SchedulerOutput, budget: int, scheduled: set[int],
               runnable: Callable[[Request], bool]) -> None:
        skipped: list[Request] = []
        while self.waiting and budget > 0 and self.slots.free_slots:
            req = self.waiting.popleft()
            if not runnable(req) or (req.lora is not None and not self._adapter_fits(req)):
                skipped.append(req)               # a paused consumer (or a busy adapter slot) holds back only itself
                continue
            hit = self._match(req)
            n = min(req.num_tokens - req.seq.num_computed, budget)
            need = self.pages_for(req.seq.num_computed + n) - len(req.seq.pages)
            pages = self._allocate(need, runnable, scheduled, out, allow_active=False)
            if pages is None:
                self._unmatch(req, hit)
                self.waiting.appendleft(req)      # head of line waits for pages
                break
            self._count_hit(req, hit)
            req.seq.pages.extend(pages)
            req.seq.slot = self.slots.acquire()
            if req.lora is not None:
                assert self.adapters is not None
                req.seq.lora_slot = self.adapters.acquire(req.lora)
            self.running.append(req)
            if req.state == RequestState.QUEUED:
                req.transition(RequestState.PREFILLING)
            out.admitted.append(req)
            scheduled.add(id(req))
            budget -= n
            out.prefill.append(ScheduledSeq(req, n, req.seq.num_computed + n == req.num_tokens))
        self.waiting.extendleft(reversed(skipped))

    def _adapter_fits(self, req: Request) -> bool:
        """Whether req's LoRA adapter has, or can take, a slot in the stacks now."""
        if self.adapters is None:
            raise RuntimeError(f"request {req.request_id} names a LoRA adapter, but this scheduler holds none")
        assert req.lora is not None
        return self.adapters.can_acquire(req.lora)

    def _match(self, req: Request) -> int:
        """Take the longest cached prefix of a request that holds no pages; tokens matched."""
        if not self.prefix_caching or req.seq.pages:
            return 0
        if req.needs_prompt_logprobs:          # cached K/V would skip the logits it asks for
            req.trace.add("prefix_cache.bypassed", reason="prompt_logprobs")
            return 0
        pages = match(self.pool, req, self.page_size)
        for p in pages:
            self.pool.retain(p)
        req.seq.pages = pages
        req.seq.pages_registered = len(pages)
        req.seq.num_computed = len(pages) * self.page_size
        return req.seq.num_computed

    def _unmatch(self, req: Request, hit: int) -> None:
        """Admission failed after a match: give the pages back, as if never matched."""
        if hit:
            pages, req.seq.pages = req.seq.pages, []
            self.pool.release(reversed(pages))
            req.seq.pages_registered = 0
            req.seq.num_computed = 0

    def _count_hit(self, req: Request, hit: int) -> None:
        if not self.prefix_caching:
            return
        first = req.first_scheduled is None
        if first:                              # prompt tokens, counted at the first admission
            self.cache_queries += len(req.prompt_ids)
            self.cache_hits += min(hit, len(req.prompt_ids))
            req.seq.cached_tokens = min(hit, len(req.prompt_ids))
        req.trace.add("prefix_cache", hit_tokens=hit, readmission=not first)

    def _grow(self, req: Request, n: int, scheduled: set[int], out: SchedulerOutput,
              runnable: Callable[[Request], bool]) -> bool:
        """Give req the pages for n more tokens, preempting others if needed. False when req
        itself had to be preempted (it was the newest candidate)."""
        need = self.pages_for(req.seq.num_computed + n) - len(req.seq.pages)
        if need <= 0:
            return True
        pages = self._allocate(need, runnable, scheduled, out, allow_active=True, owner=req)
        if pages is None:
            return False
        req.seq.pages.extend(pages)
        return True

    def _allocate(self, need: int, runnable: Callable[[Request], bool], protected: set[int],
                  out: SchedulerOutput, allow_active: bool, owner: Request | None = None) -> list[int] | None:
        """`need` pages, preempting paused requests first, then (allow_active) the newest
        running request outside `protected`; None when even that is not enough. A running
        `owner` asking for more is a candidate like the others: when it is chosen, or no other
        is left, it is preempted itself and None returned."""
        while True:
            pages = self.pool.allocate(need)
            if pages is not None:
                return pages
            victim = self._victim(runnable, protected, allow_active)
            victim = owner if victim is None else victim
            if victim is None:
                return None
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is owner:
                return None

    def _victim(self, runnable: Callable[[Request], bool], protected: set[int], allow_active: bool
                ) -> Request | None:
        candidates = [r for r in self.running if id(r) not in protected and r.seq.pages]
        paused = [r for r in candidates if not runnable(r)]
        if paused:
            return paused[-1]
        return candidates[-1] if allow_active and candidates else None

    def preempt(self, req: Request) -> None:
        self.preemptions += 1
        self.running.remove(req)
        self._give_back(req)
        req.seq.num_computed = 0
        req.trace.add("preempted", output_tokens=len(req.output_ids))
        self.waiting.appendleft(req)


def _adapter_order(s: ScheduledSeq) -> int:
    slot = s.request.seq.lora_slot
    return -1 if slot is None else slot
