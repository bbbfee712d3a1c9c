"""The gates that keep speculative decoding where it pays (speculative.py): each request's
acceptance gate and the engine's step-cost gate."""
from __future__ import annotations

from dataclasses import dataclass


FIRST_DRAFT = 2                  # a request's first run proposes at most this many tokens
# A prediction (Predicted Outputs) is the surest draft source: an output that follows it follows
# it for hundreds of tokens, so its runs are this many drafts from the first, past the configured k
# (its cursor proposes only where the output follows it: they need not earn it); prompt lookup's
# runs (backing a prediction or a draft model) may grow to it.
# Verify rows are cheap beside a step's weight reads: on SmolLM2-135M float32 (one CPU thread) a
# run kept whole at 16 drafts gives 17 tokens for 3.4x a one-row step's time (5x), at 4 drafts
# 5 tokens for 1.4x (3.6x).
PREDICTION_DRAFT = 16
# Prompt lookup backing another source is asked while its gate is off (speculative.py
# _lookup_gate): up to this many tokens it would have proposed are kept, and the gate turns back on
# once the output has followed SHADOW_FOLLOWED of them.
SHADOW_DRAFT = 8
SHADOW_FOLLOWED = 2


@dataclass
class Gate:
    """One request's acceptance gate and draft length. A verify run costs its k rows whatever
    is kept, so a request earns its length: it starts at FIRST_DRAFT, doubles (up to k) after a
    run kept whole, and falls to one past what was kept after a miss. Below `min_acceptance`
    (rolling) it proposes nothing for `backoff` steps, doubling on each new miss; when it tries
    again one short run decides (its rate restarts at the bound: a miss turns it off again).
    So a workload whose drafts fail (sampling at a high temperature over a repetitive prompt)
    spends a run of one or two rows each 8, 16, 32, ... steps, not k rows each step."""
    most: int                    # k: the configured draft tokens per run
    backoff: int                 # steps off after the next miss
    rate: float = 1.0            # rolling acceptance (accepted / proposed, exponentially weighted)
    off_until: int = 0           # no proposals before this step
    length: int = FIRST_DRAFT    # drafts the next run may propose
    earns: bool = True           # False: every run may propose `most` (a draft model that stops
                                 # where it is unsure, min_draft_confidence, sizes its own runs),
                                 # and weighs in the rolling rate by its drafts

    def __post_init__(self) -> None:
        self.length = min(self.length, self.most)

    def reopen(self, step: int, length: int, first_backoff: int) -> None:
        """Turned back on before its back-off ends (evidence from outside its runs: the output
        followed what its source would have proposed), at `length`; a miss turns it off again."""
        self.off_until = step
        self.backoff = first_backoff
        self.length = max(1, min(self.most, length))

    def record(self, accepted: int, proposed: int, step: int, min_acceptance: float, first_backoff: int) -> bool:
        """A verify run's outcome; True when it turns the request's proposals off. With
        min_acceptance 0 the gate is off: every run proposes k."""
        # a run weighs 1/2 in the rolling rate; a self-sized run (earns False) by its drafts, up
        # to 1/2 for a run of k: its runs are mostly one or two drafts, and two short misses in a
        # row (1 draft each) would have turned off a draft that keeps 80% of them
        weight = 0.5 if self.earns else 0.5 * proposed / self.most
        self.rate = (1 - weight) * self.rate + weight * accepted / proposed
        if min_acceptance == 0:
            self.length = self.most
            return False
        if not self.earns:
            self.length = self.most
        if accepted == proposed:
            self.backoff = first_backoff
            self.length = min(self.most, max(self.length, 2 * proposed))
            return False
        if self.earns:
            self.length = min(self.most, accepted + 1)
        if self.rate >= min_acceptance:
            return False
        self.off_until = step + self.backoff
        self.backoff = min(2 * self.backoff, 1024)
        self.rate = min_acceptance
        return True


class CostGate:
    """The step-cost gate: output tokens per second of steps that verify drafts against steps
    that do not, measured per batch size (decoding requests) over the engine's own steps. Where
    verifying steps run below `min_gain` times the plain ones, proposals stop at that batch size
    for a back-off (doubling while it stays so, reset when verifying pays), then are tried again.
    A step is timed from the start of one extend() to the next, so that its drafting counts in it
    (timed from the end, a draft model's forwards were charged to the step before: a plain step
    followed by a drafting one looked slow); steps with prompt chunks are not counted."""

    WARMUP = 8                   # samples of each kind before it decides
    ALPHA = 0.2                  # EWMA weight of a new sample

    def __init__(self, min_gain: float, backoff: int) -> None:
        self.min_gain, self.first_backoff = min_gain, backoff
        self.rate: dict[tuple[int, bool], tuple[float, int]] = {}    # (batch, verified) -> (tokens/s, samples)
        self.off_until: dict[int, int] = {}
        self.backoff: dict[int, int] = {}
        self._open: tuple[float, int, bool, int] | None = None          # (start, batch, verified, tokens)

    def start(self, now: float, step: int, batch: int, verified: bool, tokens: int, timed: bool) -> None:
        """A step begins (its plan known): the one before it ends now."""
        if self._open is not None:
            t0, b, v, n = self._open
            self._sample(b, v, n / max(now - t0, 1e-9), step)
        self._open = (now, batch, verified, tokens) if timed else None

    def add_tokens(self, n: int) -> None:
        if self._open is not None:
            t0, b, v, tokens = self._open
            self._open = (t0, b, v, tokens + n)

    def allows(self, batch: int, step: int) -> bool:
        """Proposals at this batch size now: not backed off, and the plain rate measured (a few
        plain steps are taken to measure it where every step found drafts)."""
        on, off = self.rate.get((batch, True)), self.rate.get((batch, False))
        if on is not None and on[1] >= self.WARMUP and (off is None or off[1] < self.WARMUP):
            return False
        return self.off_until.get(batch, 0) <= step

    def _sample(self, batch: int, verified: bool, rate: float, step: int) -> None:
        old, n = self.rate.get((batch, verified), (rate, 0))
        if n >= self.WARMUP and rate < old / 5:          # an idle gap, not a step: left out
            return
        self.rate[(batch, verified)] = (old + self.ALPHA * (rate - old) if n else rate, n + 1)
        on, off = self.rate.get((batch, True)), self.rate.get((batch, False))
        if not verified or on is None or off is None or min(on[1], off[1]) < self.WARMUP:
            return
        if on[0] < self.min_gain * off[0]:
            backoff = self.backoff.get(batch, self.first_backoff)
            self.off_until[batch] = step + backoff
            self.backoff[batch] = min(2 * backoff, 4096)
            self.rate[(batch, True)] = (on[0], self.WARMUP // 2)    # a fresh look when it tries again
        else:
            self.backoff[batch] = self.first_backoff
