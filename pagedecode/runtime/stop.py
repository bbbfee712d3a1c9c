"""Stop matching: id sequences on the token stream, strings on the detokenized text.

Both hold back the least they can: only the longest unsent suffix that is still a prefix of
some stop. The first hit absorbs the stop and everything after it. When several stops complete
at once: earliest end, then the longest, then the order given (rule version 1).
"""
from __future__ import annotations

from typing import Sequence


class StopStringMatcher:
    def __init__(self, stops: Sequence[str], include_stop: bool = False) -> None:
        self.stops = tuple(stops)
        self.include_stop = include_stop
        self.held = ""
        self._longest = max((len(s) for s in self.stops), default=0)

    def feed(self, text: str) -> tuple[str, str | None]:
        """(text safe to send now, the stop that hit or None). After a hit, the held text and
        anything later are dropped; the caller ends the request."""
        buf = self.held + text
        if not self.stops:
            self.held = ""
            return buf, None
        best = None                       # (end, -len, order, start, stop)
        for order, stop in enumerate(self.stops):
            start = buf.find(stop)
            if start >= 0:
                key = (start + len(stop), -len(stop), order, start, stop)
                best = key if best is None or key < best else best
        if best is not None:
            end, _, _, start, stop = best
            self.held = ""
            return (buf[:end] if self.include_stop else buf[:start]), stop
        hold = self._held_suffix(buf)
        self.held = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold], None

    def _held_suffix(self, buf: str) -> int:
        for n in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0

    def flush(self) -> str:
        """The request ended for another reason: the held text was never part of a stop."""
        out, self.held = self.held, ""
        return out


class StopIdMatcher:
    def __init__(self, sequences: Sequence[Sequence[int]]) -> None:
        self.sequences = tuple(tuple(s) for s in sequences)
        self.held: list[int] = []
        self._longest = max((len(s) for s in self.sequences), default=0)

    def feed(self, token: int) -> tuple[list[int], tuple[int, ...] | None]:
        """(ids safe to pass on, the sequence that hit or None)."""
        buf = self.held + [token]
        if not self.sequences:
            self.held = []
            return buf, None
        hits = [(-len(s), order, s) for order, s in enumerate(self.sequences)
                if len(s) <= len(buf) and tuple(buf[-len(s):]) == s]
        if hits:
            _, _, seq = min(hits)
            self.held = []
            return buf[:len(buf) - len(seq)], seq
        hold = 0
        for n in range(min(len(buf), self._longest - 1), 0, -1):
            if any(s[:n] == tuple(buf[-n:]) for s in self.sequences):
                hold = n
                break
        self.held = buf[len(buf) - hold:] if hold else []
        return buf[:len(buf) - hold], None

    def flush(self) -> list[int]:
        out, self.held = self.held, []
        return out
