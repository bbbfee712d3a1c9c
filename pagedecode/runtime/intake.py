"""Turning what a user sent into a Request, or an InvalidRequestError that says what is wrong.
Nothing here changes the engine's state (admission.py queues what is made): a rejected request
leaves no trace. `Intake` holds what the checks need (tokenizer, vocabulary, context, the grammar
side, the seed generator)."""
from __future__ import annotations

import numbers
import random
import time
from typing import TYPE_CHECKING, Any, Sequence

from ..errors import InvalidRequestError
from ..model.tokenizer import TokenizerLike
from ..params import SamplingParams, unicode_error
from .grammar import Constraints
from .grammar_compiler import CompileJob
from .output.pipeline import OutputPipeline
from .spec import PredictionCursor
from .prefix_cache import namespace
from .registry import RequestRegistry
from .request import Request
from .trace import Trace

if TYPE_CHECKING:
    from ..lora.adapter import LoRAAdapter

MAX_REQUEST_ID_CHARS = 256


def check_prompt_bytes(text: str, tokenizer: object, max_context: int) -> None:
    """A text too long for the context whatever it tokenizes to (Tokenizer.max_token_bytes),
    refused before the tokenizer spends a second per MiB on it."""
    most = getattr(tokenizer, "max_token_bytes", None)
    if isinstance(most, int) and len(text) > max_context * most:      # chars <= bytes: no encode yet
        size = len(text.encode())
        if size > max_context * most:
            raise InvalidRequestError(f"prompt of {size} bytes exceeds the context limit of {max_context} tokens "
                                      f"(a token stands for at most {most} bytes of this tokenizer's text)")


def prompt_ids(prompt: object, tokenizer: TokenizerLike, vocab_size: int, max_context: int) -> list[int]:
    bad = InvalidRequestError
    if isinstance(prompt, str):
        if not prompt:
            raise bad("empty prompt")
        why = unicode_error(prompt)
        if why is not None:
            raise bad(f"the prompt {why}")
        check_prompt_bytes(prompt, tokenizer, max_context)
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
                 vocab_size: int, max_context: int, rng: random.Random, trace_level: str,
                 cache_identity: str = "", constraints: Constraints | None = None,
                 job: CompileJob | None = None, lora: "LoRAAdapter | None" = None) -> Request:
    """The checked Request. A constrained one's grammar is attached (`job`: its parse, prepared
    by `Intake.prepare_grammar` outside the engine's lock)."""
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
    grammar = None
    if params.structured_output is not None:
        assert constraints is not None and job is not None, "a constrained request's grammar is prepared first"
        grammar = constraints.attach(params.structured_output, job)
    return Request(request_id=request_id, prompt_ids=ids, params=params, seed=seed, arrival=now,
                   pipeline=OutputPipeline(tokenizer, ids, params), trace=Trace(request_id, trace_level),
                   deadline=None if params.deadline_s is None else now + params.deadline_s,
                   first_token_deadline=None if params.first_token_timeout_s is None
                   else now + params.first_token_timeout_s,
                   cache_namespace=namespace(cache_identity, params.cache_salt, None if lora is None else lora.key),
                   grammar=grammar, prediction=prediction_cursor(params.prediction, tokenizer), lora=lora)


def prediction_cursor(prediction: str | Sequence[int] | None, tokenizer: TokenizerLike) -> PredictionCursor | None:
    """Predicted Outputs: the prediction's tokens (text encoded as output text is, without
    special tokens), or None when there is none."""
    if prediction is None:
        return None
    ids = tokenizer.encode(prediction, add_special_tokens=False) if isinstance(prediction, str) else list(prediction)
    return PredictionCursor(ids) if ids else None


def paired(prompts: Any, params: SamplingParams | Sequence[SamplingParams] | None
           ) -> tuple[list[Any], list[SamplingParams | None]]:
    """generate()'s arguments as a list of prompts and one SamplingParams (or None) each."""
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    plist: list[SamplingParams | None] = (list(params) if isinstance(params, (list, tuple))
                                          else [params] * len(prompts))  # type: ignore[list-item]
    if len(plist) != len(prompts):
        raise InvalidRequestError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
    return list(prompts), plist


class Intake:
    def __init__(self, tokenizer: TokenizerLike, vocab_size: int, max_context: int, constraints: Constraints,
                 seed: int | None, trace_level: str, cache_identity: str) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.constraints = constraints
        self.rng = random.Random(seed)         # draws the seeds of requests that give none
        self.trace_level = trace_level
        self.cache_identity = cache_identity   # the model's part of every prefix-cache key

    def prepare_grammar(self, params: SamplingParams | None) -> CompileJob | None:
        """Start a constrained request's parse and compile in the grammar worker; cheap, any
        thread. A constraint over the schema limits raises InvalidRequestError."""
        so = getattr(params, "structured_output", None)
        return None if so is None else self.constraints.prepare(so)

    def parsed_grammar(self, params: SamplingParams | None) -> CompileJob | None:
        """prepare_grammar, then wait for the parse (outside the engine's lock: the step loop goes on)."""
        job = self.prepare_grammar(params)
        if job is not None:
            self.constraints.wait_parsed(job)
        return job

    def make(self, prompt: object, params: SamplingParams | None, request_id: str, job: CompileJob | None,
             lora: "LoRAAdapter | None" = None) -> Request:
        return make_request(prompt, params, request_id, tokenizer=self.tokenizer, vocab_size=self.vocab_size,
                            max_context=self.max_context, rng=self.rng, trace_level=self.trace_level,
                            cache_identity=self.cache_identity, constraints=self.constraints, job=job, lora=lora)

    def make_all(self, prompts: list[Any], plist: list[SamplingParams | None], jobs: list[CompileJob | None],
                 registry: RequestRegistry, loras: "Sequence[LoRAAdapter | None]") -> list[Request]:
        """Every request checked before any is queued (a bad one raises: none is made). Each id is
        drawn from the registry and held there until all are made, so no two are the same; the
        registry is left as it was (the caller adds them)."""
        reqs: list[Request] = []
        try:
            for prompt, params, job, lora in zip(prompts, plist, jobs, loras):
                reqs.append(self.make(prompt, params, registry.new_id(), job, lora))
                registry.live[reqs[-1].request_id] = reqs[-1]   # reserve its id meanwhile
        finally:
            for req in reqs:
                del registry.live[req.request_id]
        return reqs
