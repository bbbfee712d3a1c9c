"""SamplingParams: everything a request asks of the sampler and of termination.

Checks that need no model are made here, on construction; the engine adds the checks that
need one (ids inside the vocabulary) in `add_request`. Both raise InvalidRequestError.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from .errors import InvalidRequestError

MAX_STOPS = 16          # stop strings plus stop id sequences
MAX_STOP_CHARS = 256    # longest stop string, in characters
MAX_STOP_IDS = 32       # longest stop id sequence
MAX_LOGPROBS = 20
UTF8_POLICIES = ("strict", "replace")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16                 # most output tokens to select (>= 1)
    temperature: float = 0.0             # 0 means greedy
    top_k: int = 0                       # 0 disables; keeps ties at the k-th value
    top_p: float = 1.0                   # in (0, 1]; 1 disables
    min_p: float = 0.0                   # in [0, 1]; relative to the most likely token
    repetition_penalty: float = 1.0      # > 0; over prompt and output ids (1 disables)
    presence_penalty: float = 0.0        # in [-2, 2]; over output ids
    frequency_penalty: float = 0.0       # in [-2, 2]; over output ids
    logit_bias: Mapping[int, float] | None = None
    seed: int | None = None              # None: the engine draws one per request
    stop: Sequence[str] | str = ()       # stop strings, matched on generated text
    stop_token_ids: Sequence[int | Sequence[int]] = ()   # ids or id sequences
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0                  # EOS / stop ids masked, stop strings deferred until then
    skip_special_tokens: bool = True
    logprobs: int | None = None          # None: none reported; 0..20: the chosen token's
    deadline_s: float | None = None      # seconds from add_request
    utf8_errors: str = "strict"          # "strict": an unfinished character fails; "replace"
    stop_strings: tuple[str, ...] = field(init=False, repr=False)
    stop_id_seqs: tuple[tuple[int, ...], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"invalid SamplingParams: {msg}")

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad(f"top_k must be an integer >= 0 (0 disables), got {self.top_k!r}")
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_real(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if (not _is_real(self.repetition_penalty) or not math.isfinite(self.repetition_penalty)
                or self.repetition_penalty <= 0):
            raise bad(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not (-2.0 <= v <= 2.0):
                raise bad(f"{name} must be in [-2, 2], got {v!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise bad("logit_bias must be a mapping of token id to bias")
            for tok, b in self.logit_bias.items():
                if not _is_int(tok) or tok < 0:
                    raise bad(f"logit_bias key {tok!r} is not a token id")
                if not _is_real(b) or not (math.isfinite(b) or b == -math.inf):
                    raise bad(f"logit_bias for {tok} must be finite or -inf, got {b!r}")
        if self.seed is not None and (not _is_int(self.seed) or not (0 <= self.seed < 2**64)):
            raise bad(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        for s in stops:
            if not isinstance(s, str):
                raise bad(f"stop strings must be str, got {s!r}")
            if s == "":
                raise bad("an empty stop string would match everywhere")
            if len(s) > MAX_STOP_CHARS:
                raise bad(f"stop string longer than {MAX_STOP_CHARS} characters")
        id_seqs = []
        for item in self.stop_token_ids:
            seq: tuple | None = (item,) if _is_int(item) else tuple(item) if isinstance(item, Sequence) else None
            if not seq or not all(_is_int(t) and t >= 0 for t in seq):
                raise bad(f"stop_token_ids entries must be ids or non-empty id sequences, got {item!r}")
            if len(seq) > MAX_STOP_IDS:
                raise bad(f"stop id sequence longer than {MAX_STOP_IDS}")
            id_seqs.append(seq)
        if len(stops) + len(id_seqs) > MAX_STOPS:
            raise bad(f"at most {MAX_STOPS} stops, got {len(stops) + len(id_seqs)}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.deadline_s is not None and (not _is_real(self.deadline_s) or not math.isfinite(self.deadline_s)
                                            or self.deadline_s <= 0):
            raise bad(f"deadline_s must be a finite number > 0, got {self.deadline_s!r}")
        if self.utf8_errors not in UTF8_POLICIES:
            raise bad(f"utf8_errors must be one of {UTF8_POLICIES}, got {self.utf8_errors!r}")
        for flag in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, flag), bool):
                raise bad(f"{flag} must be a bool")
        object.__setattr__(self, "stop_strings", stops)
        object.__setattr__(self, "stop_id_seqs", tuple(id_seqs))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_vocab(self, vocab_size: int) -> None:
        """The checks that need the model: every id named must be inside its vocabulary."""
        ids = list(self.logit_bias or ()) + [t for seq in self.stop_id_seqs for t in seq]
        out = [t for t in ids if t >= vocab_size]
        if out:
            raise InvalidRequestError(f"token ids {out[:5]} are outside the vocabulary of {vocab_size}")
