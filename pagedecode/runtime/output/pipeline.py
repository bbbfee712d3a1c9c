"""From selected tokens to what the client sees: detokenizer, stop ids and stop strings.

Every token goes to the detokenizer at once, so stop strings see its text in the same step
(a partly matched stop id sequence never delays a stop string). What may still be cut is held:

    produced text   [ released | unreleased ........................................ ]
                                ^ base      ^ fed_at of the first token a stop id     ^
                                              sequence may still claim    longest suffix that
                                                                           starts a stop string
A token id (and its logprob) is released with the first delta that carries any of its text;
ids whose text is still held (unfinished character, possible stop) wait with it.

A stop id sequence that hits cuts the text from where its first token's text began (the
absorbed ids are never shown); held text that no stop matched is sent. A stop string that
ends earlier than that cut wins.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ...model.tokenizer import TokenizerLike
from ...params import SamplingParams
from .detokenizer import Utf8TailError, make_detokenizer
from .events import TopLogprobs
from .stop import StopIdMatcher, find_stop_string, stop_prefix_len


@dataclass
class Emission:
    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float | None, ...] = ()
    top_logprobs: tuple[TopLogprobs, ...] = ()     # per released token (empty tuples when none asked)
    stop: str | tuple[int, ...] | None = None      # the stop that hit, if one did
    error: str | None = None                       # an unfinished UTF-8 tail under "strict"


class _Pending:
    __slots__ = ("token", "logprob", "top", "fed_at", "start")

    def __init__(self, token: int, logprob: float | None, top: TopLogprobs, fed_at: int) -> None:
        self.token, self.logprob, self.top = token, logprob, top
        self.fed_at = fed_at                   # text produced before it was decoded
        self.start: int | None = None          # offset of its first character, once it has one


class OutputPipeline:
    def __init__(self, tokenizer: TokenizerLike, prompt_ids: list[int], params: SamplingParams) -> None:
        self.detok = make_detokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self.stop_ids = StopIdMatcher(params.stop_id_seqs)
        self.stops = params.stop_strings
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.utf8_errors = params.utf8_errors
        self._text = ""              # produced, not yet released (starts at offset _base)
        self._base = 0               # characters released so far
        self._pending: list[_Pending] = []
        self._held_since: float | None = None
        self.hold_s = 0.0
        self._top: TopLogprobs = ()

    @property
    def held_chars(self) -> int:
        return len(self._text)

    def push(self, token: int, logprob: float | None, n_selected: int, top: TopLogprobs | None = None) -> Emission:
        """Take the n_selected-th output token (1-based). Inside min_tokens, stops don't match."""
        self._top = top or ()
        if not self._pending and not self._text and not self.stop_ids.sequences:
            return self._push_unheld(token, logprob, n_selected)
        if n_selected <= self.min_tokens:
            self._decode(token, logprob)
            return self._release(len(self._text))
        hit = self.stop_ids.feed(token)
        if hit is not None:
            return self._id_stop(hit, logprob)
        self._decode(token, logprob)
        return self._match_strings()

    def _push_unheld(self, token: int, logprob: float | None, n_selected: int) -> Emission:
        """The common case, nothing held and no stop ids: a token whose text neither is nor
        starts a stop goes straight out, without the bookkeeping of held text."""
        piece = self.detok.add(token)
        if not piece:                               # inside a character: the id waits for its text
            self._pending.append(_Pending(token, logprob, self._top, self._base))
            return Emission()
        stops = self.stops
        if (not stops or n_selected <= self.min_tokens
                or (find_stop_string(piece, stops) is None and not stop_prefix_len(piece, stops))):
            self._base += len(piece)
            return Emission(piece, (token,), (logprob,), (self._top,))
        self._pending.append(_Pending(token, logprob, self._top, self._base))
        self._note_text(piece)
        return self._match_strings()

    def _match_strings(self) -> Emission:
        """Release what no stop string can still claim (the text is decoded, stop ids fed)."""
        stopped = self._stop_at_string(self._text)
        if stopped is not None:
            return stopped
        keep = stop_prefix_len(self._text, self.stops) if self.stops else 0
        end = len(self._text) - keep
        if self.stop_ids.held:
            end = min(end, self._pending[-self.stop_ids.held].fed_at - self._base)
        return self._release(end)

    def _stop_at_string(self, text: str) -> Emission | None:
        """The first stop string in `text` (the unreleased text, or a prefix of it) ends the
        output: release up to it (or through it, include_stop) and cut. None when none is there."""
        found = find_stop_string(text, self.stops) if self.stops else None
        if found is None:
            return None
        return self._release(found.end if self.include_stop else found.start, cut=True, stop=found.stop)

    def _decode(self, token: int, logprob: float | None) -> None:
        self._pending.append(_Pending(token, logprob, self._top, self._base + len(self._text)))
        self._note_text(self.detok.add(token))

    def _note_text(self, piece: str) -> None:
        if not piece:
            return
        offset = self._base + len(self._text)
        for p in self._pending:
            if p.start is None:
                p.start = offset
        self._text += piece

    def _id_stop(self, hit: tuple[int, ...], logprob: float | None) -> Emission:
        if len(hit) == 1:                    # the token itself is never decoded: close what is open
            cut = self._base + len(self._text)
            self._note_text(self._complete_tail())
        else:                                # its earlier tokens were decoded: cut where they began
            cut = self._pending[-(len(hit) - 1)].fed_at
        before = self._text[:cut - self._base]
        stopped = self._stop_at_string(before)
        if stopped is not None:              # a stop string ended earlier: it wins
            return stopped
        return self._release(cut - self._base, cut=True, stop=hit)

    def _complete_tail(self) -> str:
        """What the detokenizer holds that is already complete text (an unfinished character
        is dropped: the stop cut the output there)."""
        try:
            return self.detok.flush("strict")
        except Utf8TailError:
            return ""

    def finish(self, errors: str | None = None) -> Emission:
        """The request ends for a reason other than a stop: everything held is sent.
        errors: "strict" / "replace" for an unfinished character, "drop" to discard it."""
        errors = errors or self.utf8_errors
        self.stop_ids.release()
        error = None
        try:
            tail = self._complete_tail() if errors == "drop" else self.detok.flush(errors)
        except Utf8TailError as e:
            tail, error = "", str(e)
        self._note_text(tail)
        stopped = self._stop_at_string(self._text)
        if stopped is not None:              # held ids completed a stop string after all
            return stopped
        em = self._release(len(self._text), everything=True)
        em.error = error
        return em

    def _release(self, n_chars: int, cut: bool = False, everything: bool = False,
                 stop: str | tuple[int, ...] | None = None) -> Emission:
        """Send the first n_chars of the unreleased text; `cut`: the rest is dropped for good."""
        n_chars = max(0, n_chars)
        text, self._text = self._text[:n_chars], ("" if cut else self._text[n_chars:])
        self._base += len(text)
        now = time.perf_counter()
        if self._held_since is not None and (text or cut or everything):
            self.hold_s += now - self._held_since
            self._held_since = None
        if self._text and self._held_since is None:
            self._held_since = now
        out: list[_Pending] = []
        keep: list[_Pending] = []
        for p in self._pending:
            shown = p.start is not None and p.start < self._base
            (out if shown or everything else keep).append(p)
        self._pending = [] if cut else keep
        return Emission(text, tuple(p.token for p in out), tuple(p.logprob for p in out),
                        tuple(p.top for p in out), stop)
