"""Stop matching: id sequences on the token stream, strings on the detokenized text.

Both hold back the least they can: only the longest unsent suffix that is still a prefix of
some stop. When several stops complete at once: earliest end, then the longest, then the
order given (rule version 1). Both are pure: they keep no text of their own beyond what the
caller passes in.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence


class StringHit(NamedTuple):
    start: int       # where the stop string starts in the searched text
    end: int
    stop: str


def find_stop_string(text: str, stops: Sequence[str]) -> StringHit | None:
    """The stop that ends earliest in text (then the longest, then the first given)."""
    best: tuple[int, int, int, int, str] | None = None
    for order, stop in enumerate(stops):
        start = text.find(stop)
        if start >= 0:
            key = (start + len(stop), -len(stop), order, start, stop)
            if best is None or key < best:
                best = key
    if best is None:
        return None
    return StringHit(best[3], best[0], best[4])


def stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string."""
    longest = max((len(s) for s in stops), default=0)
    for n in range(min(len(text), longest - 1), 0, -1):
        tail = text[-n:]
        if any(s.startswith(tail) for s in stops):
            return n
    return 0


class StopIdMatcher:
    """Id sequences over the token stream. `held` trailing tokens may still start a stop."""

    def __init__(self, sequences: Sequence[Sequence[int]]) -> None:
        self.sequences = tuple(tuple(s) for s in sequences)
        self._longest = max((len(s) for s in self.sequences), default=0)
        self._recent: list[int] = []      # the last (longest - 1) tokens seen
        self.held = 0

    def feed(self, token: int) -> tuple[int, ...] | None:
        """The sequence this token completes (the longest, then the first given), or None."""
        if not self.sequences:
            return None
        buf = self._recent + [token]
        hits = [(-len(s), order, s) for order, s in enumerate(self.sequences)
                if len(s) <= len(buf) and tuple(buf[-len(s):]) == s]
        if hits:
            self._recent, self.held = [], 0
            return min(hits)[2]
        self.held = 0
        for n in range(min(len(buf), self._longest - 1), 0, -1):
            if any(s[:n] == tuple(buf[-n:]) for s in self.sequences):
                self.held = n
                break
        self._recent = buf[-(self._longest - 1):] if self._longest > 1 else []
        return None

    def release(self) -> None:
        """The request ends otherwise: held tokens were not part of a stop."""
        self._recent, self.held = [], 0
