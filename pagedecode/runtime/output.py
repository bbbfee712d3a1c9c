"""From selected tokens to what the client sees: stop ids -> detokenizer -> stop strings.

A token id (and its logprob) is released with the first delta that carries any of its text;
ids whose text is still held (unfinished character, possible stop prefix) wait with it.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from ..params import SamplingParams
from .detokenizer import IncrementalDetokenizer, Utf8TailError
from .stop import StopIdMatcher, StopStringMatcher


@dataclass
class Emission:
    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    stop: str | tuple[int, ...] | None = None      # the stop that hit, if one did
    error: str | None = None                       # an unfinished UTF-8 tail under "strict"


class _Pending:
    __slots__ = ("token", "logprob", "start")

    def __init__(self, token: int, logprob: float) -> None:
        self.token, self.logprob = token, logprob
        self.start: int | None = None          # offset of its first character, once it has one


class OutputPipeline:
    def __init__(self, tokenizer, prompt_ids, params: SamplingParams) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self.stop_ids = StopIdMatcher(params.stop_id_seqs)
        self.stop_strings = StopStringMatcher(params.stop_strings, params.include_stop_str_in_output)
        self.min_tokens = params.min_tokens
        self.utf8_errors = params.utf8_errors
        self._id_held: deque[tuple[int, float]] = deque()    # mirrors stop_ids.held, with logprobs
        self._pending: list[_Pending] = []                    # passed on, not yet released
        self._text_total = 0        # characters produced by the detokenizer so far
        self._released = 0          # characters sent
        self._held_since: float | None = None
        self.hold_s = 0.0

    def push(self, token: int, logprob: float, n_selected: int) -> Emission:
        """Take the n_selected-th output token (1-based). Inside min_tokens, stops don't match."""
        protected = n_selected <= self.min_tokens
        if protected:
            passed, id_hit = [token], None
            self._id_held.append((token, logprob))
        else:
            self._id_held.append((token, logprob))
            passed, id_hit = self.stop_ids.feed(token)
        text, string_hit = self._pass_on(len(passed), protected)
        if string_hit is not None:
            return self._release(text, cut=True, stop=string_hit)
        if id_hit is not None:
            return self._release(text, cut=True, stop=id_hit)
        return self._release(text)

    def finish(self, errors: str | None = None) -> Emission:
        """The request ends for a reason other than a stop: everything held is sent.
        errors: "strict" / "replace" for an unfinished character, "drop" to discard it."""
        errors = errors or self.utf8_errors
        text, hit = self._pass_on(len(self.stop_ids.flush()), protected=False)
        error = None
        if hit is not None:                     # held ids completed a stop string after all
            return self._release(text, cut=True, stop=hit)
        try:
            tail = self.detok.flush("replace" if errors == "drop" else errors)
            if errors == "drop":
                tail = ""
        except Utf8TailError as e:
            tail, error = "", str(e)
        if tail:
            self._note_text(tail)
        more, hit = self.stop_strings.feed(tail)
        text += more
        if hit is not None:
            return self._release(text, cut=True, stop=hit)
        text += self.stop_strings.flush()
        em = self._release(text, everything=True)
        em.error = error
        return em

    def _pass_on(self, n: int, protected: bool) -> tuple[str, str | None]:
        """Feed the first n id-held tokens to the detokenizer and the stop-string matcher."""
        out = []
        for _ in range(n):
            token, lp = self._id_held.popleft()
            self._pending.append(_Pending(token, lp))
            piece = self.detok.add(token)
            if not piece:
                continue
            self._note_text(piece)
            if protected:
                out.append(self.stop_strings.flush() + piece)
                continue
            released, hit = self.stop_strings.feed(piece)
            out.append(released)
            if hit is not None:
                return "".join(out), hit
        return "".join(out), None

    def _note_text(self, piece: str) -> None:
        for p in self._pending:
            if p.start is None:
                p.start = self._text_total
        self._text_total += len(piece)

    def _release(self, text: str, cut: bool = False, everything: bool = False, stop=None) -> Emission:
        self._released += len(text)
        now = time.perf_counter()
        if self._held_since is not None and (text or cut or everything):
            self.hold_s += now - self._held_since
            self._held_since = None
        if self.stop_strings.held and self._held_since is None:
            self._held_since = now
        keep: list[_Pending] = []
        out: list[_Pending] = []
        for p in self._pending:
            shown = p.start is not None and p.start < self._released
            (out if shown or everything else keep).append(p)
        self._pending = [] if cut else keep
        return Emission(text, tuple(p.token for p in out), tuple(p.logprob for p in out), stop)
