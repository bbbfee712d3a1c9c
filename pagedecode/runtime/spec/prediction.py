"""Predicted Outputs (OpenAI's `prediction`): text the client expects the output to repeat mostly
(a file it asks to edit, a document to reformat). Its tokens are the request's draft source,
verified as any draft is (speculative.py), so the output is the one the engine makes without it.

The cursor keeps where in the prediction the output stands:

    prediction:  p0 p1 p2 p3 p4 p5 p6 p7 ...
    output:      p0 p1 p2 x  y  p5 p6 ...        (an edit: p3 p4 became x y)
                          ^ diverged; after "x y p5" the output's last tokens are found in the
                            prediction again (the longest suffix of up to MAX_ANCHOR tokens, at
                            least MIN_ANCHOR, at or after the cursor first) and drafting resumes

While the output follows the prediction token for token, the cursor only moves forward; after a
divergence it proposes nothing until the output's suffix re-appears in the prediction. Meanwhile
(and past the prediction's end) the request drafts from its own tokens, as n-gram speculation
does (speculative.py): what a small model adds after an edited file, a list or a loop, repeats
itself. The cursor counts only its own drafts, which the usage reports as the prediction's.
"""
from __future__ import annotations

from array import array

_ITEM = array("q").itemsize


class PredictionCursor:
    MIN_ANCHOR = 3       # output tokens that must match the prediction to re-synchronise
    MAX_ANCHOR = 8       # ... the longest suffix tried first

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self._data = array("q", tokens).tobytes()
        self.pos: int | None = 0          # the prediction index the next output token should equal
        self.floor = 0                     # where the output last followed it (re-sync looks on from here first)
        self.seen = 0                      # output tokens taken into account so far
        self.drafted = 0                   # the prediction's tokens drafted and verified ...
        self.accepted = 0                  # ... and of them, selected

    def propose(self, output: list[int], k: int) -> list[int]:
        """Up to k drafts: the prediction's tokens after where the output stands."""
        for token in output[self.seen:]:
            if self.pos is not None and self.pos < len(self.tokens) and self.tokens[self.pos] == token:
                self.pos += 1
                self.floor = self.pos
            else:
                self.pos = None
        self.seen = len(output)
        if self.pos is None:
            self.pos = self._resync(output)
        if self.pos is None or k < 1:
            return []
        return self.tokens[self.pos:self.pos + k]

    def _resync(self, output: list[int]) -> int | None:
        """Just past the output's longest suffix found in the prediction: its first occurrence
        after where the output last followed the prediction (an edit keeps the prediction's
        order), else its first anywhere; None if no suffix of MIN_ANCHOR tokens occurs."""
        for n in range(min(self.MAX_ANCHOR, len(output)), self.MIN_ANCHOR - 1, -1):
            suffix = array("q", output[-n:]).tobytes()
            for start in (self.floor, 0):
                at = self._find(suffix, start * _ITEM)
                if at is not None:
                    return at + n
        return None

    def _find(self, suffix: bytes, start: int) -> int | None:
        at = self._data.find(suffix, start)
        while at >= 0 and at % _ITEM:                   # aligned on a token, not inside one
            at = self._data.find(suffix, at + 1)
        return None if at < 0 else at // _ITEM
