"""The page allocator: reference counts, a free list, and an integrity check."""
from __future__ import annotations

from collections import Counter, deque
from typing import Iterable

from ..errors import DoubleReleaseError


class PagePool:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"the page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.ref_counts = [0] * num_pages
        self._free: deque[int] = deque(range(num_pages))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n fresh pages with ref count 1, or None (and nothing taken) when too few are free."""
        if n > len(self._free):
            return None
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self.ref_counts[p] = 1
        return pages

    def retain(self, page: int) -> None:
        """Share an in-use page (one more owner)."""
        if self.ref_counts[page] <= 0:
            raise DoubleReleaseError(f"page {page} is free; it cannot be shared")
        self.ref_counts[page] += 1

    def release(self, pages: Iterable[int]) -> None:
        """Drop one reference to each page; a page whose count reaches 0 is free again.
        Releasing a page that is already free raises: that is a double release."""
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
                self._free.append(p)

    def check_integrity(self) -> None:
        """free + in use == total, no page twice in the free list, counts agree with the list."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a page appears twice in the free list")
        in_use = {p for p, c in enumerate(self.ref_counts) if c > 0}
        if any(c < 0 for c in self.ref_counts):
            raise AssertionError("negative page reference count")
        if free & in_use:
            raise AssertionError(f"pages both free and in use: {sorted(free & in_use)[:8]}")
        if len(free) + len(in_use) != self.num_pages:
            raise AssertionError(f"free {len(free)} + in use {len(in_use)} != total {self.num_pages}")
