"""Turning what a user sent into a Request, or an InvalidRequestError that says what is wrong.
Nothing here touches the engine's state: a rejected request leaves no trace."""
from __future__ import annotations

import numbers
import random
import time

from ..errors import InvalidRequestError
from ..model.tokenizer import TokenizerLike
from ..params import SamplingParams, unicode_error
from .output import OutputPipeline
from .request import Request
from .trace import Trace

MAX_REQUEST_ID_CHARS = 256


def prompt_ids(prompt: object, tokenizer: TokenizerLike, vocab_size: int, max_context: int) -> list[int]:
    bad = InvalidRequestError
    if isinstance(prompt, str):
        if not prompt:
            raise bad("empty prompt")
        why = unicode_error(prompt)
        if why is not None:
            raise bad(f"the prompt {why}")
        try:
            ids = list(tokenizer.encode(prompt))
        except Exception as e:
            raise bad(f"the tokenizer cannot encode the prompt: {e}") from None
    elif isinstance(prompt, (list, tuple)):
        if any(not isinstance(t, numbers.Integral) or isinstance(t, bool) for t in prompt):
            raise bad("a prompt given as ids must hold only ints")
        ids = [int(t) for t in prompt]
    else:
        raise bad(f"prompt must be str or list[int], got {type(prompt).__name__}")
    if not ids:
        raise bad("empty prompt")
    out = [t for t in ids if not 0 <= t < vocab_size]
    if out:
        raise bad(f"prompt ids {out[:5]} are outside the vocabulary of {vocab_size}")
    if len(ids) > max_context:
        raise bad(f"prompt of {len(ids)} tokens exceeds the context limit of {max_context}")
    return ids


def make_request(prompt: object, params: SamplingParams | None, request_id: str, *, tokenizer: TokenizerLike,
                 vocab_size: int, max_context: int, rng: random.Random, trace_level: str) -> Request:
    if params is None:
        params = SamplingParams()
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"params must be a pd.SamplingParams, got {type(params).__name__}")
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequestError(f"request_id must be a non-empty str, got {request_id!r}")
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError(f"request_id is {len(request_id)} characters long; at most {MAX_REQUEST_ID_CHARS}"
                                  f" (it is in every event, trace and log line)")
    why = unicode_error(request_id)
    if why is not None:
        raise InvalidRequestError(f"request_id {why}")
    ids = prompt_ids(prompt, tokenizer, vocab_size, max_context)
    params.check_vocab(vocab_size)
    now = time.perf_counter()
    seed = params.seed if params.seed is not None else rng.getrandbits(64)
    req = Request(request_id=request_id, prompt_ids=ids, params=params, seed=seed, arrival=now,
                  pipeline=OutputPipeline(tokenizer, ids, params), trace=Trace(request_id, trace_level),
                  deadline=None if params.deadline_s is None else now + params.deadline_s,
                  first_token_deadline=None if params.first_token_timeout_s is None
                  else now + params.first_token_timeout_s)
    return req
