"""Closing a constrained tool call within its request's budget. A call held to its schema can
still run on (a free-text string argument never has to end) until max_tokens cuts it, and a cut
call does not parse. A constraint with `close_after` (tool calls: tools/constraint.py) is watched
as its budget runs out (max_tokens, and the context's room): the token selected for it is kept
while the shortest way to finish the grammar after it still fits the tokens left; otherwise it
is replaced by the first token of the way to finish from before it. The model writes what it
likes while its call can still close, and the call always closes in time: its arguments parse
and validate, and it ends as a finished call would (a stop token, or the grammar allowing
nothing else), its content truncated rather than the call cut.

The way to finish (Closer.way), one token at a time on the request's own matcher (each token
accepted, all rolled back at the end: the matcher is left as found), each step the first of:

    a stop token, where one is allowed (the way ends; the token is left out where nothing but
        a stop token is allowed: the engine ends the request without one, grammar_complete)
    the forced text (xgrammar's jump-forward string), in the longest vocabulary tokens
    the first allowed of CLOSERS (close a string, an object, an array; the shortest value; the
        next required property), then of the one-byte tokens, in id order, then of all tokens
    ... except that after LOOP steps that left the allowed set unchanged (a `0` in the pattern
    `[a-z0-9.]+@...` could repeat forever), the first one-byte token that changes it.

Cost: a watch checks a token only near the end of the budget. The slack is the tokens left
less the way's length; within the longest way seen plus MARGIN every token is checked (a way
grows with what the model opens: another call, whose way is as long as the first one's was from
its start; a nested object's required properties; a property whose value is a long const);
beyond, the next check comes after a quarter of the distance to there. So growth of up to the
longest way plus MARGIN in one token, or three tokens per token sustained, is caught; more, and
a call can still be cut (then, as before, finish_reason "length"). A check first tries the last way
again after the token (inside a string it still fits: a few µs per token, one mask fill), else
simulates the way afresh (two mask fills per step where no text is forced); far from the end
nothing runs.

Exactness: what is kept or replaced depends only on the request (its matcher, its output, its
budget) and the token selected for it, decided where every constrained token is selected
(StepRunner.select, speculation's later depths included), so speculation, chunked prefill, the
prefix cache and the batch around it change nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

CLOSERS = (b'"', b"}", b"]", b"0", b",")
MARGIN = 16           # slack (tokens) under which every token is checked
SPREAD = 4            # beyond it, the next check comes after a quarter of the slack over MARGIN
LOOP = 4              # way steps with the allowed set unchanged before a token that changes it is sought


@dataclass
class CloseWatch:
    """One request's watch (GrammarState.close)."""
    after: tuple[bytes, ...]        # a call is open to close once the output holds one of these (auto's
                                    # triggers); empty: from the first token (named, required)
    started: bool = False
    check_at: int = 0               # the output length at which the next selected token is checked
    way: list[int] | None = None    # the way to finish from output length way_at (the last check's)
    way_at: int = -1
    scanned: int = 0                # output tokens searched for `after`
    tail: bytes = b""               # the end of the text searched (a trigger may span tokens)
    longest: int = 0                # the longest way seen (a call's own length, from its start)

    def __post_init__(self) -> None:
        self.started = not self.after


class Closer:
    """The engine's way finder: the vocabulary's bytes (as the grammar reads them), its stop ids,
    a scratch bitmask. Built once the grammar backend is (grammar_compiler.GrammarCompiler)."""

    def __init__(self, token_bytes: Sequence[bytes], stop_ids: Sequence[int], vocab_size: int) -> None:
        self.token_bytes = token_bytes
        self.by_bytes: dict[bytes, int] = {}
        for i, b in enumerate(token_bytes):
            if b and b not in self.by_bytes:           # the lowest id of equal bytes
                self.by_bytes[b] = i
        self.longest = max((len(b) for b in self.by_bytes), default=1)
        one_byte = sorted(i for b, i in self.by_bytes.items() if len(b) == 1)
        closers = [self.by_bytes[c] for c in CLOSERS if c in self.by_bytes]
        self.candidates = closers + [i for i in one_byte if i not in closers]
        self.stop_ids = list(stop_ids)
        self.mask = torch.zeros((2, -(-vocab_size // 32)), dtype=torch.int32)   # rows: now, after a candidate

    # -- a selected token ------------------------------------------------------------------------
    def check(self, w: CloseWatch, matcher: Any, output: Sequence[int], token: int, budget: int) -> int | None:
        """The token to select instead of `token` (None: keep it), for a request whose output so
        far is `output` and that may select `budget` more tokens, this one included. The caller
        checks a token when it is due (w.check_at)."""
        t = len(output)
        if token in self.stop_ids:
            return None
        if not w.started and not self._started(w, output):
            return None
        if w.way_at == t and w.way and w.way[0] == token:
            ahead: list[int] | None = w.way[1:]          # the model chose the way's own token
        else:
            if not matcher.accept_token(token):
                raise RuntimeError(f"the grammar rejected token {token} (a bug: the mask allowed it)")
            try:
                ahead = self._again(matcher, w.way, budget - 1) if w.way_at == t else None
                if ahead is None:
                    ahead = self.way(matcher, budget - 1)
            finally:
                matcher.rollback(1)
        if ahead is not None:
            self._next_check(w, t + 1, budget - 1, ahead)
            return None
        way = w.way if w.way_at == t else self.way(matcher, budget)
        if not way:                                       # no way within the budget: left to be cut
            w.check_at = t + budget + 1
            return None
        self._next_check(w, t + 1, budget - 1, way[1:])
        return way[0]

    @staticmethod
    def _next_check(w: CloseWatch, t: int, budget: int, way: list[int]) -> None:
        """The way from output length t, with `budget` tokens left there: the next check is at
        once where the slack is within the longest way seen and MARGIN (one token may grow the
        way that much: another call, a property whose value is a long const), else a quarter of
        the way there."""
        w.way, w.way_at = way, t
        w.longest = max(w.longest, len(way))
        w.check_at = t + max(0, budget - len(way) - w.longest - MARGIN) // SPREAD

    def _started(self, w: CloseWatch, output: Sequence[int]) -> bool:
        """Whether the output holds one of the watch's triggers (searched once per token)."""
        table = self.token_bytes
        text = w.tail + b"".join(table[i] for i in output[w.scanned:] if 0 <= i < len(table))
        w.scanned = len(output)
        w.started = any(a in text for a in w.after)
        keep = max(len(a) for a in w.after) - 1
        w.tail = text[max(0, len(text) - keep):] if keep > 0 else b""
        return w.started

    def _again(self, matcher: Any, way: list[int] | None, limit: int) -> list[int] | None:
        """`way` (the way from before the token just accepted) when it still finishes the grammar
        from here within `limit`, else None: inside a string, most tokens leave the way to finish
        as it was, and trying it costs no mask fill but the last."""
        if not way or len(way) > limit:
            return None
        taken = 0
        try:
            for token in way:
                if not matcher.accept_token(token):
                    return None
                taken += 1
            return way if way[-1] in self.stop_ids or self._only_stops(matcher) else None
        finally:
            if taken:
                matcher.rollback(taken)

    # -- the way to finish -----------------------------------------------------------------------
    def way(self, matcher: Any, limit: int) -> list[int] | None:
        """The tokens that finish the grammar from the matcher's state (module docstring), None
        when they are more than `limit` or none are found. The matcher is left as found."""
        taken: list[int] = []
        same = 0
        try:
            while True:
                stop = self._stop_allowed(matcher)
                if stop is not None and self._only_stops(matcher):
                    return taken
                if len(taken) == limit:
                    return None
                if stop is not None:
                    return taken + [stop]
                token, changed = self._step(matcher, same >= LOOP)
                if token is None:
                    return None
                taken.append(token)
                same = 0 if changed else same + 1
        finally:
            if taken:
                matcher.rollback(len(taken))

    def _stop_allowed(self, matcher: Any) -> int | None:
        for s in self.stop_ids:
            if matcher.accept_token(s):
                matcher.rollback(1)
                return s
        return None

    def _only_stops(self, matcher: Any) -> bool:
        matcher.fill_next_token_bitmask(self.mask, 0)
        return not bool(self._without_stops().any())

    def _step(self, matcher: Any, escape: bool) -> tuple[int | None, bool]:
        """One token of the way, accepted, and whether it changed the allowed set (forced text
        counts as a change). escape: prefer a token that changes it."""
        forced = matcher.find_jump_forward_string().encode()
        for n in range(min(len(forced), self.longest), 0, -1):
            token = self.by_bytes.get(forced[:n])
            if token is not None and matcher.accept_token(token):
                return token, True
        matcher.fill_next_token_bitmask(self.mask, 0)
        first: int | None = None
        for token in self.candidates:
            if not matcher.accept_token(token):
                continue
            matcher.fill_next_token_bitmask(self.mask, 1)
            changed = not torch.equal(self.mask[0], self.mask[1])
            if changed or not escape:
                return token, changed
            matcher.rollback(1)
            if first is None:
                first = token
        if first is None:                                 # only longer tokens are allowed
            first = self._lowest_allowed()
        if first is not None and not matcher.accept_token(first):
            return None, False
        return first, False

    def _lowest_allowed(self) -> int | None:
        """The lowest id row 0 of the scratch mask allows, stop tokens aside."""
        row = self._without_stops()
        words = torch.nonzero(row).flatten()
        if words.numel() == 0:
            return None
        w = int(words[0])
        bits = int(row[w]) & 0xFFFFFFFF
        return w * 32 + (bits & -bits).bit_length() - 1

    def _without_stops(self) -> torch.Tensor:
        """Row 0 of the scratch mask with the stop tokens' bits cleared."""
        row = self.mask[0].clone()
        for s in self.stop_ids:
            bit = 1 << (s % 32)
            row[s // 32] &= ~(bit - (1 << 32) if bit >= 1 << 31 else bit)     # as int32
        return row
