"""The request-field table of completions and chat (`FIELDS`): each entry names one request
field, the endpoints that read it, and what reading it does to the `Draft` (what the table has
read so far). A field the sampler takes goes to SamplingParams' keyword arguments as the client
gave it (SamplingParams checks every type and range: params.FIELD_CHECKS); the server adds only
its own caps (`Limits`, MAX_N, the prompts per request) and reads the fields that are its own (n,
echo, stream, stream_options, on_disconnect, ...). protocol.py runs the table over a body, then
the rules that join fields.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..errors import InvalidFieldError, InvalidRequestError
from ..params import MAX_LOGPROBS, MAX_STOP_CHARS, check_field, int_error, is_int, show
from .errors import ApiError, bad
from .integers import parse_decimal

MAX_N = 16              # n's own cap; a batch's choices (prompts x n) are at most max(MAX_N, max_prompts)
COMPLETIONS_LOGPROBS = 5     # /v1/completions' logprobs: at most 5 alternatives (OpenAI's bound)
BIAS_RANGE = 100        # OpenAI's logit_bias values are in [-100, 100]


@dataclass
class Limits:
    """Server-wide caps (safe defaults): what one request may ask for. Each is at most what
    SamplingParams itself allows (params.py); lower, the server refuses more."""
    max_tokens: int = 4096
    max_stops: int = 8
    max_stop_chars: int = MAX_STOP_CHARS
    max_logit_bias: int = 300
    max_top_logprobs: int = MAX_LOGPROBS
    max_request_seconds: float | None = None


Prompt = str | list[int]


@dataclass
class Draft:
    """What the table has read so far: the request's own fields, and SamplingParams' keyword
    arguments as the request gave them (`sampling`, under SamplingParams' names)."""
    chat: bool
    limits: Limits
    max_prompts: int
    sampling: dict[str, Any] = field(default_factory=dict)
    fields: dict[str, str] = field(default_factory=dict)      # SamplingParams' names -> the request's
    messages: list[dict[str, Any]] | None = None
    prompts: list[Prompt] = field(default_factory=list)
    echo: bool = False
    sse: bool = False
    include_usage: bool = False
    n: int = 1
    on_disconnect: str | None = None
    max_name: str | None = None           # the field max_tokens came from (chat: max_completion_tokens first)
    wants_logprobs: bool = False          # chat's logprobs: true
    top_logprobs: Any = None              # chat's top_logprobs, as given
    logprobs: int | None = None           # completions' logprobs
    vllm_prompt_logprobs: int | None = None
    add_generation_prompt: bool = True    # chat (vLLM's fields): the template opens the assistant's turn ...
    continue_final_message: bool = False  # ... or the last message, an answer begun, is continued


Reader = Callable[[Any, Draft], None]     # (the field's value, never None; the draft so far)


@dataclass(frozen=True)
class Field:
    """One request field: its name, what reading it does, the endpoints that read it, and
    whether it must be given (else a field that is absent or null is not read)."""
    name: str
    read: Reader
    on: tuple[str, ...] = ("completions", "chat")
    required: bool = False


def checked(name: str, to: str, value: Any) -> Any:
    """value checked as SamplingParams' field `to` (a 400 naming the request's field `name`)."""
    try:
        check_field(to, value)
    except InvalidRequestError as e:
        raise invalid(e, {to: name}) from None
    return value


def sampled(to: str, name: str | None = None) -> Reader:
    """A field passed to SamplingParams' `to` as given: SamplingParams checks it."""
    def read(value: Any, d: Draft) -> None:
        d.sampling[to] = value
        d.fields[to] = name or to
    return read


def boolean(body: Mapping[str, Any], name: str, default: bool = False, within: str = "") -> bool:
    """body[name] as true / false (absent or null: default); a 400 naming within + name otherwise."""
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(within + name, f"must be true or false, got {v!r}")
    return v


# -- the server's own fields ----------------------------------------------------------------------
def _echo(value: Any, d: Draft) -> None:
    d.echo = boolean({"echo": value}, "echo")
    if d.echo and d.chat:
        raise bad("echo", "is supported on /v1/completions only")


def _prompt_logprobs(value: Any, d: Draft) -> None:
    if d.chat:
        raise bad("prompt_logprobs", "is supported on /v1/completions only")
    cap = d.limits.max_top_logprobs
    if checked("prompt_logprobs", "prompt_logprobs", value) > cap:
        raise bad("prompt_logprobs", f"must be in [0, {cap}], got {value}")
    d.vllm_prompt_logprobs = value


def _unsupported(name: str, ok: Callable[[Any], bool]) -> Reader:
    def read(value: Any, d: Draft) -> None:
        if not ok(value):
            raise bad(name, "is not supported by this server")
    return read


def _user(value: Any, d: Draft) -> None:
    if not isinstance(value, str):
        raise bad("user", "must be a string")


def _messages(value: Any, d: Draft) -> None:
    if not isinstance(value, list) or not value:
        raise bad("messages", "must be a non-empty list of {role, content} objects")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}]", "must be an object with a string role")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise bad(f"messages[{i}].content", "must be a string or a list of text parts")
    d.messages = value


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(is_int(t) for t in value)


def _prompts(value: Any, d: Draft) -> None:
    """A completions request's prompts: a string, a list of token ids, or a batch (a list of
    strings or of token-id lists, at most max_prompts); a batch of one is that one prompt."""
    if isinstance(value, str) and value or _token_ids(value):
        d.prompts = [value]
        return
    if not isinstance(value, list) or not value or not all(isinstance(p, (str, list)) for p in value):
        raise bad("prompt", "must be a non-empty string, a list of token ids, or a list of them (a batch)")
    if len(value) > d.max_prompts:
        raise bad("prompt", f"at most {d.max_prompts} prompts per request, got {len(value)}")
    for i, p in enumerate(value):
        if not (isinstance(p, str) and p or _token_ids(p)):
            raise bad("prompt", f"prompt[{i}] must be a non-empty string or a non-empty list of token ids")
    d.prompts = list(value)


def _max_tokens(name: str) -> Reader:
    """max_tokens (chat: max_completion_tokens, which wins when both are given), in
    [1, limits.max_tokens] ([0, ...] with echo: true)."""
    def read(value: Any, d: Draft) -> None:
        if d.max_name is not None:
            return
        cap = d.limits.max_tokens
        if not (1 if not d.echo else 0) <= checked(name, "max_tokens", value) <= cap:
            echo = "" if d.chat else " ([0, ...] with echo: true)"      # echo is /v1/completions' alone
            raise bad(name, f"must be in [1, {cap}]{echo}, got {value}")
        d.max_name = name
        sampled("max_tokens", name)(value, d)
    return read


def _n(value: Any, d: Draft) -> None:
    why = int_error(value, 1, MAX_N)
    if why is not None:
        raise bad("n", f"{why}, got {show(value)}")
    d.n = value


def _stop(value: Any, d: Draft) -> None:
    stops = checked("stop", "stop", value)
    stops = (stops,) if isinstance(stops, str) else stops
    lim = d.limits
    if len(stops) > lim.max_stops or any(len(s) > lim.max_stop_chars for s in stops):
        raise bad("stop", f"at most {lim.max_stops} stops of at most {lim.max_stop_chars} characters")
    sampled("stop")(value, d)


def _logit_bias(value: Any, d: Draft) -> None:
    """JSON's keys are strings: token ids written as text; values in OpenAI's [-100, 100]."""
    most = d.limits.max_logit_bias
    if not isinstance(value, dict) or len(value) > most:
        raise bad("logit_bias", f"must be an object of at most {most} token ids")
    bias = {}
    for k, v in value.items():
        token = parse_decimal(k)
        if token is None:
            raise bad("logit_bias", f"key {k!r} is not a token id (ASCII decimal digits)")
        bias[token] = v
    checked("logit_bias", "logit_bias", bias)
    for k, v in value.items():
        if not -BIAS_RANGE <= v <= BIAS_RANGE:
            raise bad("logit_bias", f"bias for {k} must be in [-{BIAS_RANGE}, {BIAS_RANGE}], got {v!r}")
    sampled("logit_bias")({tok: float(v) for tok, v in bias.items()}, d)


def _completions_logprobs(value: Any, d: Draft) -> None:
    most = min(COMPLETIONS_LOGPROBS, d.limits.max_top_logprobs)
    if checked("logprobs", "logprobs", value) > most:
        raise bad("logprobs", f"must be in [0, {COMPLETIONS_LOGPROBS}] for completions")
    d.logprobs = value


def _chat_logprobs(value: Any, d: Draft) -> None:
    d.wants_logprobs = boolean({"logprobs": value}, "logprobs")


def _chat_top_logprobs(value: Any, d: Draft) -> None:
    d.top_logprobs = value           # checked with logprobs (_logprobs)


def _prediction(value: Any, d: Draft) -> None:
    """OpenAI's Predicted Outputs: {"type": "content", "content": text, or a list of text parts}."""
    if not isinstance(value, dict) or value.get("type") != "content":
        raise bad("prediction", 'must be {"type": "content", "content": ...}')
    content = value.get("content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise bad("prediction.content", "must be a string or a list of text parts")
    sampled("prediction", "prediction.content")(content, d)


def _stream(value: Any, d: Draft) -> None:
    d.sse = boolean({"stream": value}, "stream")


def _add_generation_prompt(value: Any, d: Draft) -> None:
    d.add_generation_prompt = boolean({"add_generation_prompt": value}, "add_generation_prompt", True)


def _continue_final_message(value: Any, d: Draft) -> None:
    d.continue_final_message = boolean({"continue_final_message": value}, "continue_final_message")


def _stream_options(value: Any, d: Draft) -> None:
    if not isinstance(value, dict):
        raise bad("stream_options", "must be an object")
    d.include_usage = boolean(value, "include_usage", within="stream_options.")


def _on_disconnect(value: Any, d: Draft) -> None:
    if value not in ("cancel", "continue"):
        raise bad("on_disconnect", 'must be "cancel" or "continue"')
    d.on_disconnect = value


CHAT, COMPLETIONS = ("chat",), ("completions",)
# SamplingParams' fields a request names alike, passed as given
SAMPLED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
           "seed", "stop_token_ids", "ignore_eos", "min_tokens", "skip_special_tokens", "include_stop_str_in_output")
# in the order a body is read (of several fields in error, the first is named)
FIELDS: tuple[Field, ...] = (
    Field("echo", _echo),
    Field("prompt_logprobs", _prompt_logprobs),
    Field("best_of", _unsupported("best_of", lambda v: v == 1)),
    Field("suffix", _unsupported("suffix", lambda v: not v)),
    Field("tools", _unsupported("tools", lambda v: not v), COMPLETIONS),
    Field("user", _user),
    Field("messages", _messages, CHAT, required=True),
    Field("prompt", _prompts, COMPLETIONS, required=True),
    Field("max_completion_tokens", _max_tokens("max_completion_tokens"), CHAT),
    Field("max_tokens", _max_tokens("max_tokens")),
    Field("n", _n),
    Field("stop", _stop),
    Field("logit_bias", _logit_bias),
    Field("logprobs", _chat_logprobs, CHAT),
    Field("top_logprobs", _chat_top_logprobs, CHAT),
    Field("logprobs", _completions_logprobs, COMPLETIONS),
    Field("prediction", _prediction, CHAT),
    Field("add_generation_prompt", _add_generation_prompt, CHAT),
    Field("continue_final_message", _continue_final_message, CHAT),
    Field("stream_options", _stream_options),
    Field("stream", _stream),
    Field("timeout", sampled("deadline_s", "timeout")),
    Field("first_token_timeout", sampled("first_token_timeout_s", "first_token_timeout")),
    Field("on_disconnect", _on_disconnect),
    *(Field(name, sampled(name)) for name in SAMPLED),
)


def invalid(e: InvalidRequestError, fields: Mapping[str, str]) -> ApiError:
    """The engine's own validation as a 400 naming the request's field (the engine names its
    own field, `SamplingParams.<name>`; `fields` maps its names to the request's where they
    differ; a prompt the engine refuses is the prompt)."""
    param: str | None = None
    if isinstance(e, InvalidFieldError):
        param = fields.get(e.field, e.field)
    elif "prompt" in str(e):
        param = fields.get("prompt", "prompt")
    return ApiError(400, str(e), param=param, code="invalid_value")
