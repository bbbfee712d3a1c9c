"""SamplingParams: everything a request asks of the sampler and of termination.

Checks that need no model are made here, on construction; the engine adds the checks that
need one (ids inside the vocabulary) in `add_request`. Both raise InvalidRequestError.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from .errors import InvalidFieldError
from .structured import StructuredOutput

MAX_STOPS = 16          # stop strings plus stop id sequences
MAX_STOP_CHARS = 256    # longest stop string, in characters
MAX_STOP_IDS = 32       # longest stop id sequence
MAX_LOGPROBS = 20
MAX_INT32 = 2**31 - 1   # the sampler's integer fields (top_k, ids, counts) are int32
FLOAT32_MAX = 3.4e38    # the sampler computes in float32
MAX_BIAS = 1e6          # |logit_bias| beyond this only overflows; -inf bans a token
MAX_PREDICTION = 1 << 20   # Predicted Outputs: characters of text, or token ids
REPETITION_RANGE = (0.01, 100.0)
UTF8_POLICIES = ("strict", "replace")


def is_int(x: Any) -> bool:
    """An integer, and not a bool (JSON's true is no token id)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def unicode_error(s: str) -> str | None:
    """Why s is not valid Unicode (a lone surrogate, which JSON's "\\ud800" can carry), or None."""
    if s.isascii():
        return None
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"holds a lone surrogate {s[e.start]!r} at character {e.start}, which is not valid Unicode"
    return None


def show(value: Any) -> str:
    """A value as an error message quotes it: repr, cut at 200 characters."""
    try:
        text = repr(value)
    except ValueError:                      # an int over sys.get_int_max_str_digits() digits
        return f"an integer of {value.bit_length()} bits"
    return text if len(text) <= 200 else text[:200] + "..."


def int_error(v: Any, lo: int, hi: int) -> str | None:
    """Why v is not an integer in [lo, hi], or None."""
    if not is_int(v) or not lo <= v <= hi:
        return f"must be an integer in [{lo}, {hi}]"
    return None


def real_error(v: Any, lo: float, hi: float, lo_open: bool = False) -> str | None:
    """Why v is not a finite number in [lo, hi] ((lo, hi] when lo_open), or None."""
    # an int beyond float's range is out of range (math.isfinite would raise OverflowError on it)
    if not is_real(v) or (not is_int(v) and not math.isfinite(v)) or v < lo or v > hi or (lo_open and v == lo):
        return f"must be a number in {'(' if lo_open else '['}{lo}, {hi}]"
    return None


def _bad(name: str, msg: str, value: Any) -> InvalidFieldError:
    return InvalidFieldError("SamplingParams", name, f"{msg}, got {show(value)}")


Check = Callable[[str, Any], None]      # (field name, value): raises InvalidFieldError naming the field


def _ints(lo: int, hi: int) -> Check:
    def check(name: str, v: Any) -> None:
        why = int_error(v, lo, hi)
        if why is not None:
            raise _bad(name, why, v)
    return check


def _reals(lo: float, hi: float, lo_open: bool = False) -> Check:
    def check(name: str, v: Any) -> None:
        why = real_error(v, lo, hi, lo_open)
        if why is not None:
            raise _bad(name, why, v)
    return check


def _optional(check: Check) -> Check:
    def optional(name: str, v: Any) -> None:
        if v is not None:
            check(name, v)
    return optional


def _flag(name: str, v: Any) -> None:
    if not isinstance(v, bool):
        raise _bad(name, "must be a bool", v)


def _logit_bias(name: str, bias: Any) -> None:
    if not isinstance(bias, Mapping):
        raise _bad(name, "must be a mapping of token id to bias", bias)
    for tok, b in bias.items():
        if not is_int(tok) or not 0 <= tok <= MAX_INT32:
            raise _bad(name, "keys must be token ids", tok)
        if not is_real(b) or not (abs(b) <= MAX_BIAS or b == -math.inf):
            raise _bad(name, f"values must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}] or -inf", b)


def _structured(name: str, v: Any) -> None:
    if not isinstance(v, StructuredOutput):
        raise _bad(name, "must be a pd.StructuredOutput", v)


def _cache_salt(name: str, v: Any) -> None:
    if not isinstance(v, str) or unicode_error(v):
        raise _bad(name, "must be a string of valid Unicode", v)


def _prediction(name: str, v: Any) -> None:
    if isinstance(v, str):
        if unicode_error(v):
            raise _bad(name, "must be a string of valid Unicode", v)
        if len(v) > MAX_PREDICTION:
            raise _bad(name, f"at most {MAX_PREDICTION} characters", len(v))
        return
    if not isinstance(v, (list, tuple)) or not all(is_int(t) and 0 <= t <= MAX_INT32 for t in v):
        raise _bad(name, "must be the predicted text (a str) or its token ids", v)
    if len(v) > MAX_PREDICTION:
        raise _bad(name, f"at most {MAX_PREDICTION} token ids", len(v))


def _utf8_policy(name: str, v: Any) -> None:
    if v not in UTF8_POLICIES:
        raise _bad(name, f"must be one of {UTF8_POLICIES}", v)


def _stop_strings(v: Any) -> tuple[str, ...]:
    stops = (v,) if isinstance(v, str) else v
    if not isinstance(stops, (list, tuple)):
        raise _bad("stop", "must be a str or a list of str", v)
    for s in stops:
        if not isinstance(s, str):
            raise _bad("stop", "must hold only strings", s)
        if s == "":
            raise _bad("stop", "an empty stop string would match everywhere", s)
        if len(s) > MAX_STOP_CHARS:
            raise _bad("stop", f"a stop string is longer than {MAX_STOP_CHARS} characters", s[:40] + "...")
        why = unicode_error(s)
        if why is not None:
            raise _bad("stop", f"a stop string {why}", s)
    return tuple(stops)


def _stop_id_seqs(v: Any) -> tuple[tuple[int, ...], ...]:
    if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)):
        raise _bad("stop_token_ids", "must be a list of token ids or of id sequences", v)
    if len(v) > MAX_STOPS:                       # bounded before any entry is looked at
        raise _bad("stop_token_ids", f"at most {MAX_STOPS} stops (strings and id sequences together)", len(v))
    seqs = []
    for item in v:
        seq = (item,) if is_int(item) else tuple(item) if isinstance(item, (list, tuple)) else None
        if not seq or not all(is_int(t) and 0 <= t <= MAX_INT32 for t in seq):
            raise _bad("stop_token_ids", "entries must be token ids or non-empty id sequences", item)
        if len(seq) > MAX_STOP_IDS:
            raise _bad("stop_token_ids", f"an id sequence is longer than {MAX_STOP_IDS}", item)
        seqs.append(tuple(int(t) for t in seq))
    return tuple(seqs)


def _check(normalize: Callable[[Any], Any], v: Any) -> None:
    normalize(v)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16                 # most output tokens to select (>= 1; 0 only with prompt_logprobs)
    temperature: float = 0.0             # 0 means greedy
    top_k: int = 0                       # 0 disables; keeps ties at the k-th value
    top_p: float = 1.0                   # in (0, 1]; 1 disables
    min_p: float = 0.0                   # in [0, 1]; relative to the most likely token
    repetition_penalty: float = 1.0      # in [0.01, 100]; over prompt and output ids (1 disables)
    presence_penalty: float = 0.0        # in [-2, 2]; over output ids
    frequency_penalty: float = 0.0       # in [-2, 2]; over output ids
    logit_bias: Mapping[int, float] | None = None   # id -> bias in [-1e6, 1e6], or -inf
    seed: int | None = None              # None: the engine draws one per request
    stop: Sequence[str] | str = ()       # stop strings, matched on generated text
    stop_token_ids: Sequence[int | Sequence[int]] = ()   # ids or id sequences
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0                  # EOS / stop ids masked, stop strings deferred until then
    skip_special_tokens: bool = True
    logprobs: int | None = None          # None: none reported; 0..20: the chosen token's
    prompt_logprobs: int | None = None   # None: off; 0: each prompt token's logprob; N: also its N most likely
    deadline_s: float | None = None      # seconds from add_request
    first_token_timeout_s: float | None = None   # no token selected within it: FAILED deadline_exceeded
    utf8_errors: str = "strict"          # "strict": an unfinished character fails; "replace"
    cache_salt: str | None = None        # prefix cache: requests with different salts share nothing
    structured_output: StructuredOutput | None = None    # JSON schema / regex / EBNF / choice constraint
    prediction: str | Sequence[int] | None = None   # Predicted Outputs: text (or ids) the output is expected
                                                    # to repeat mostly; proposed as drafts, verified exactly
    stop_strings: tuple[str, ...] = field(init=False, repr=False)
    stop_id_seqs: tuple[tuple[int, ...], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name, check in FIELD_CHECKS.items():
            check(name, getattr(self, name))
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise _bad("max_tokens", "0 asks for nothing (it is allowed only with prompt_logprobs)", 0)
        stops = _stop_strings(self.stop)
        id_seqs = _stop_id_seqs(self.stop_token_ids)
        if len(stops) + len(id_seqs) > MAX_STOPS:
            raise _bad("stop", f"at most {MAX_STOPS} stops (strings and id sequences together)",
                       len(stops) + len(id_seqs))
        if self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", f"must not exceed max_tokens ({self.max_tokens})", self.min_tokens)
        object.__setattr__(self, "stop_strings", stops)
        object.__setattr__(self, "stop_id_seqs", id_seqs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_vocab(self, vocab_size: int) -> None:
        """The checks that need the model: every id named must be inside its vocabulary."""
        for name, ids in (("logit_bias", list(self.logit_bias or ())),
                          ("stop_token_ids", [t for seq in self.stop_id_seqs for t in seq]),
                          ("prediction", [] if isinstance(self.prediction, str) else list(self.prediction or ()))):
            out = [t for t in ids if t >= vocab_size]
            if out:
                raise _bad(name, f"token ids outside the vocabulary of {vocab_size}", out[:5])


# Each field's type and range, checked on construction in this order; the rules that join two
# fields (max_tokens 0, the stop count, min_tokens <= max_tokens) are in __post_init__.
FIELD_CHECKS: dict[str, Check] = {
    "prompt_logprobs": _optional(_ints(0, MAX_LOGPROBS)),
    "max_tokens": _ints(0, MAX_INT32),
    "temperature": _reals(0.0, FLOAT32_MAX),
    "top_k": _ints(0, MAX_INT32),
    "top_p": _reals(0.0, 1.0, lo_open=True),
    "min_p": _reals(0.0, 1.0),
    "repetition_penalty": _reals(*REPETITION_RANGE),
    "presence_penalty": _reals(-2.0, 2.0),
    "frequency_penalty": _reals(-2.0, 2.0),
    "logit_bias": _optional(_logit_bias),
    "seed": _optional(_ints(0, 2**64 - 1)),
    "stop": lambda name, v: _check(_stop_strings, v),
    "stop_token_ids": lambda name, v: _check(_stop_id_seqs, v),
    "min_tokens": _ints(0, MAX_INT32),
    "logprobs": _optional(_ints(0, MAX_LOGPROBS)),
    "deadline_s": _optional(_reals(0.0, 1e9, lo_open=True)),
    "first_token_timeout_s": _optional(_reals(0.0, 1e9, lo_open=True)),
    "structured_output": _optional(_structured),
    "prediction": _optional(_prediction),
    "cache_salt": _optional(_cache_salt),
    "utf8_errors": _utf8_policy,
    "include_stop_str_in_output": _flag,
    "ignore_eos": _flag,
    "skip_special_tokens": _flag,
}


def check_field(name: str, value: Any) -> None:
    """One SamplingParams field's type and range check, as construction makes it, for a caller
    that needs the value checked before it builds the params (the server, to apply its caps):
    raises InvalidFieldError naming the field."""
    FIELD_CHECKS[name](name, value)
