"""Consistent hashing over the replicas: the router's owner of a key (pagedecode/ray/router.py)."""
from __future__ import annotations

import bisect
import hashlib

RING_POINTS = 64                 # virtual nodes per replica on the hash ring


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class Ring:
    """Consistent hashing: RING_POINTS points per replica; a key's owner is the first live
    replica clockwise from the key's point."""

    def __init__(self, n: int) -> None:
        self.points = sorted((_point(f"replica-{i}#{v}"), i) for i in range(n) for v in range(RING_POINTS))
        self.keys = [p for p, _ in self.points]

    def owner(self, key: str, live: set[int]) -> int | None:
        start = bisect.bisect(self.keys, _point(key))
        for k in range(len(self.points)):
            i = self.points[(start + k) % len(self.points)][1]
            if i in live:
                return i
        return None
