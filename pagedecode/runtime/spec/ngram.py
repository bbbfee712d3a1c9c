"""The n-gram proposer of speculative decoding (speculative.py): prompt lookup in a request's own
tokens, nothing shared between requests."""
from __future__ import annotations

import weakref
from array import array
from typing import Sequence

from ..request import Request

_ITEM = array("q").itemsize


class NgramProposer:
    """Prompt lookup: the longest suffix of the request's tokens (max_ngram down to min_ngram)
    that occurred earlier in them; the tokens that followed its most recent earlier occurrence
    are the draft."""

    def __init__(self, min_ngram: int, max_ngram: int) -> None:
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self._kept: weakref.WeakKeyDictionary[Request, bytearray] = weakref.WeakKeyDictionary()

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        return self._search(array("q", tokens).tobytes(), k)

    def propose_for(self, req: Request, k: int) -> list[int]:
        """propose() over the request's prompt and output, its bytes kept from one step to the
        next and extended by the tokens since (they only grow), not rebuilt each step."""
        kept = self._kept.get(req)
        if kept is None:
            kept = self._kept[req] = bytearray(array("q", req.prompt_ids).tobytes())
        have = len(kept) // _ITEM - len(req.prompt_ids)
        if have < len(req.output_ids):
            kept += array("q", req.output_ids[have:]).tobytes()
        return self._search(kept, k)

    def _search(self, data: bytes | bytearray, k: int) -> list[int]:
        n_tokens = len(data) // _ITEM
        if k < 1 or n_tokens <= self.min_ngram:
            return []
        for n in range(min(self.max_ngram, n_tokens - 1), self.min_ngram - 1, -1):
            suffix = data[(n_tokens - n) * _ITEM:]
            end = (n_tokens - 1) * _ITEM            # a match ends before the last token
            while True:
                at = data.rfind(suffix, 0, end)
                if at < 0:
                    break
                if at % _ITEM == 0:                 # aligned on a token, not inside one
                    start = (at // _ITEM + n) * _ITEM
                    return array("q", data[start:start + k * _ITEM]).tolist()
                end = at + len(suffix) - 1
        return []
