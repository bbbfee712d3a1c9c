"""The page allocator: reference counts, a free list, the prefix cache's hashed pages, and an
integrity check.

Every page is in exactly one of three sets:
    free        ref 0, no hash: handed out first
    evictable   ref 0, hashed: a cached prefix page nobody uses, least recently used first;
                allocation takes it (dropping its hash) only when no free page is left
    in use      ref >= 1 (hashed or not); a hashed in-use page is shared, full, never written
A hash maps to one page and back (`by_hash` / `page_hash` are inverse). A hashed page keeps
its token ids and its parent (the hashed page before it in its chain, None for a first page),
and a lookup confirms both, so a hit is confirmed along the whole chain: a hash collision can
never hand one prompt another prompt's K/V, not even a page holding the same tokens after a
different prefix. A page that loses its hash takes its descendants' hashes with it (their
parent is gone), so a parent is always a live hashed page.

With a sink to publish to (`publish`), the pool keeps a log of its cache's changes for the KV-event
publisher (pagedecode/kv_events.py): ("stored", page, key, parent key or None, tokens) when a page
is hashed, ("removed", key) when a hash is dropped; the engine flushes it to the sink after each step.
"""
from __future__ import annotations

from collections import Counter, OrderedDict, deque
from typing import Any, Callable, Iterable, Sequence

from ..errors import DoubleReleaseError

CacheEvent = tuple[Any, ...]      # ("stored", page, key, parent key, tokens) or ("removed", key)


class PagePool:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"the page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.ref_counts = [0] * num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._evictable: OrderedDict[int, None] = OrderedDict()     # oldest first
        self.by_hash: dict[bytes, int] = {}
        self.page_hash: dict[int, bytes] = {}
        self._tokens: dict[int, tuple[int, ...]] = {}
        self._parent: dict[int, int | None] = {}
        self._children: dict[int, set[int]] = {}
        self.record_events = False
        self.events: list[CacheEvent] = []
        self._sink: Callable[[list[CacheEvent]], None] | None = None

    @property
    def free_pages(self) -> int:
        """Pages an allocation can take now (free, or cached but unused)."""
        return len(self._free) + len(self._evictable)

    @property
    def cached_pages(self) -> int:
        return len(self.page_hash)

    def allocate(self, n: int) -> list[int] | None:
        """n pages with ref count 1, or None (and nothing taken) when too few are available.
        Never-hashed pages go first, then the least recently used cached ones."""
        if n > self.free_pages:
            return None
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._evictable.popitem(last=False)
                self._unhash(page)
            self.ref_counts[page] = 1
            pages.append(page)
        return pages

    def retain(self, page: int) -> None:
        """One more owner of a page in use, or of a cached one (which leaves the evictable set)."""
        if self.ref_counts[page] <= 0:
            if page not in self._evictable:
                raise DoubleReleaseError(f"page {page} is free; it cannot be shared")
            del self._evictable[page]
        self.ref_counts[page] += 1

    def release(self, pages: Iterable[int]) -> None:
        """Drop one reference to each page, in the order given (give a request's pages tail first:
        its chain's tail then becomes evictable before its head). A page whose count reaches 0 is
        free again, or evictable when it is hashed. Releasing more than is held raises."""
        pages = list(pages)
        for p, times in Counter(pages).items():
            if not 0 <= p < self.num_pages:
                raise ValueError(f"page {p} is outside the pool of {self.num_pages}")
            if self.ref_counts[p] < times:
                raise DoubleReleaseError(f"page {p} released more often than it is held "
                                         f"({times} releases, {self.ref_counts[p]} references)")
        for p in pages:
            self.ref_counts[p] -= 1
            if self.ref_counts[p] == 0:
                if p in self.page_hash:
                    self._evictable[p] = None
                else:
                    self._free.append(p)

    # -- the prefix cache's pages ------------------------------------------------------------
    def register(self, page: int, key: bytes, tokens: Sequence[int], parent: int | None) -> bool:
        """Record that an in-use, fully written page holds `tokens` under `key`, after the hashed
        page `parent` (None: the chain's first page). False (nothing changes) when the key already
        names a page, the page already has a hash, or the parent is not hashed."""
        if self.ref_counts[page] <= 0:
            raise AssertionError(f"page {page} is not in use; only written pages are registered")
        if key in self.by_hash or page in self.page_hash or (parent is not None and parent not in self.page_hash):
            return False
        self.by_hash[key] = page
        self.page_hash[page] = key
        self._tokens[page] = tuple(tokens)
        self._parent[page] = parent
        if parent is not None:
            self._children.setdefault(parent, set()).add(page)
        if self.record_events:
            self.events.append(("stored", page, key, None if parent is None else self.page_hash[parent],
                                tuple(tokens)))
        return True

    def lookup(self, key: bytes, tokens: Sequence[int], parent: int | None) -> int | None:
        """The cached page for key that holds exactly `tokens` right after the page `parent`
        (None: first in its chain), or None."""
        page = self.by_hash.get(key)
        if page is None or self._tokens.get(page) != tuple(tokens) or self._parent.get(page) != parent:
            return None
        if page in self._evictable:
            self._evictable.move_to_end(page)       # recently used
        return page

    def _unhash(self, page: int) -> None:
        """Drop a page's hash, and its descendants' (an evictable one becomes free)."""
        parent = self._parent.get(page)
        if parent is not None:
            self._children[parent].discard(page)
            if not self._children[parent]:
                del self._children[parent]
        todo = [page]
        while todo:
            p = todo.pop()
            key = self.page_hash.pop(p)
            del self.by_hash[key]
            if self.record_events:
                self.events.append(("removed", key))
            del self._tokens[p], self._parent[p]
            todo.extend(self._children.pop(p, ()))
            if p != page and p in self._evictable:
                del self._evictable[p]
                self._free.append(p)

    def publish(self, sink: Callable[[list[CacheEvent]], None] | None) -> None:
        """Log the cache's changes from now on for sink (None: stop logging)."""
        self.record_events = sink is not None
        self.events.clear()
        self._sink = sink

    def flush_events(self) -> None:
        """Hand the changes logged since the last flush to the sink, oldest first (none: no call)."""
        if self._sink is not None and self.events:
            events, self.events = self.events, []
            self._sink(events)

    def clear_cache(self) -> None:
        """Forget every cached page nobody uses (they become free)."""
        while self._evictable:
            page, _ = self._evictable.popitem(last=False)
            self._unhash(page)
            self._free.append(page)

    def check_integrity(self) -> None:
        """free, evictable and in use are disjoint and add up to the pool; hashes and pages are
        inverse maps; every hashed page is in use or evictable; counts agree with the sets."""
        free, evictable = set(self._free), set(self._evictable)
        if len(free) != len(self._free):
            raise AssertionError("a page appears twice in the free list")
        if any(c < 0 for c in self.ref_counts):
            raise AssertionError("negative page reference count")
        in_use = {p for p, c in enumerate(self.ref_counts) if c > 0}
        for a, b, what in ((free, in_use, "free and in use"), (evictable, in_use, "evictable and in use"),
                           (free, evictable, "free and evictable")):
            if a & b:
                raise AssertionError(f"pages both {what}: {sorted(a & b)[:8]}")
        if len(free) + len(evictable) + len(in_use) != self.num_pages:
            raise AssertionError(f"free {len(free)} + evictable {len(evictable)} + in use {len(in_use)} "
                                 f"!= total {self.num_pages}")
        if any(self.by_hash.get(k) != p for p, k in self.page_hash.items()) or len(self.by_hash) != len(self.page_hash):
            raise AssertionError("hash -> page and page -> hash are not inverse")
        if set(self._tokens) != set(self.page_hash) or set(self._parent) != set(self.page_hash):
            raise AssertionError("a hashed page without its tokens and parent (or those without a hash)")
        children = {(parent, p) for p, parent in self._parent.items() if parent is not None}
        if any(parent not in self.page_hash for parent, _ in children):
            raise AssertionError("a hashed page whose parent is not hashed")
        if children != {(parent, c) for parent, cs in self._children.items() for c in cs} or \
                any(not cs for cs in self._children.values()):
            raise AssertionError("parent -> children and child -> parent disagree")
        if not evictable <= set(self.page_hash):
            raise AssertionError("an evictable page without a hash")
        if free & set(self.page_hash):
            raise AssertionError("a free page still hashed")
