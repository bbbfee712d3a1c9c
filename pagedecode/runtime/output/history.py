"""A finished request's events, kept compactly for replay and results.

While a request is live its history is a list of event objects. When it ends, the deltas
are packed into one string and a few arrays (about 12 bytes per delta plus the text, instead
of ~230 bytes per event object) and rebuilt on demand: a replay gets the same events, with
the same sequence numbers, as the live stream did.
"""
from __future__ import annotations

from array import array
from typing import Iterator

from .events import DeltaEvent, Event, StartEvent, TerminalEvent, TopLogprobs


class CompactHistory:
    def __init__(self, events: list[Event]) -> None:
        self.start: StartEvent | None = None
        self.terminal: TerminalEvent | None = None
        self.request_id = events[0].request_id if events else ""
        texts: list[str] = []
        self._text_ends = array("I")          # end offset of each delta's text in _text
        self._id_ends = array("I")            # end offset of each delta's ids in _ids
        self._ids = array("q")
        self._seqs = array("I")
        self._logprobs: list[float | None] | None = None
        self._top: list[TopLogprobs] | None = None
        length = 0
        for ev in events:
            if isinstance(ev, StartEvent):
                self.start = ev
            elif isinstance(ev, TerminalEvent):
                self.terminal = ev
            else:
                texts.append(ev.text)
                length += len(ev.text)
                self._text_ends.append(length)
                self._ids.extend(ev.token_ids)
                self._id_ends.append(len(self._ids))
                self._seqs.append(ev.seq)
                if ev.logprobs is not None:
                    if self._logprobs is None:
                        self._logprobs = []
                    self._logprobs.extend(ev.logprobs)
                if ev.top_logprobs is not None:
                    if self._top is None:
                        self._top = []
                    self._top.extend(ev.top_logprobs)
        self._text = "".join(texts)

    def __len__(self) -> int:
        return len(self._seqs) + (self.start is not None) + (self.terminal is not None)

    def deltas(self) -> list[DeltaEvent]:
        out = []
        t0 = i0 = 0
        for k, seq in enumerate(self._seqs):
            t1, i1 = self._text_ends[k], self._id_ends[k]
            lps = None if self._logprobs is None else tuple(self._logprobs[i0:i1])
            top = None if self._top is None else tuple(self._top[i0:i1])
            out.append(DeltaEvent(self.request_id, seq, self._text[t0:t1], tuple(self._ids[i0:i1]), lps, top))
            t0, i0 = t1, i1
        return out

    def __iter__(self) -> Iterator[Event]:
        if self.start is not None:
            yield self.start
        yield from self.deltas()
        if self.terminal is not None:
            yield self.terminal

    @property
    def text(self) -> str:
        return self._text

    @property
    def token_ids(self) -> list[int]:
        """Every returned id, in order (what the deltas carried)."""
        return self._ids.tolist()

    @property
    def logprobs(self) -> list[float | None] | None:
        return None if self._logprobs is None else list(self._logprobs)

    @property
    def top_logprobs(self) -> list[TopLogprobs] | None:
        return None if self._top is None else list(self._top)

    def kept_bytes(self) -> int:
        """Bytes this history holds (arrays, text, logprobs, the two events)."""
        arrays = sum(a.itemsize * len(a) + 64 for a in (self._text_ends, self._id_ends, self._ids, self._seqs))
        text = len(self._text.encode()) + 80
        lps = 0 if self._logprobs is None else 32 * len(self._logprobs)
        lps += 0 if self._top is None else sum(120 * len(t) + 56 for t in self._top)
        return arrays + text + lps + 600
