"""OpenAI-compatible request parsing and response shapes.

Parsing turns a JSON body into (prompt, SamplingParams, options) or raises ApiError naming the
field; the engine's own validation (InvalidRequestError) is mapped to the same 400 shape.
"""
from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..errors import InvalidRequestError
from ..params import MAX_LOGPROBS, SamplingParams
from ..runtime.events import RequestOutput, Usage
from ..runtime.lifecycle import FinishReason
from .errors import ApiError

# pagedecode's reasons as OpenAI clients know them; every other reason keeps its own name
OPENAI_FINISH = {FinishReason.EOS: "stop", FinishReason.STOP_SEQUENCE: "stop", FinishReason.GRAMMAR_COMPLETE: "stop",
                 FinishReason.MAX_OUTPUT_TOKENS: "length", FinishReason.CONTEXT_LIMIT: "length"}

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "seed")


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


@dataclass
class Limits:
    """Server-wide caps (safe defaults): what one request may ask for."""
    max_tokens: int = 4096
    max_stops: int = 8
    max_stop_chars: int = 256
    max_logit_bias: int = 300
    max_top_logprobs: int = MAX_LOGPROBS
    max_request_seconds: float | None = None


MAX_N = 16              # n's own cap; a batch's choices (prompts x n) are at most max(MAX_N, max_prompts)


Prompt = str | list[int]


@dataclass
class Parsed:
    prompt: Prompt | None                 # the first (or only) prompt; chat: None
    messages: list[dict[str, Any]] | None
    params: SamplingParams
    stream: bool
    include_usage: bool
    n: int
    first_token_timeout: float | None
    on_disconnect: str | None
    top_logprobs: int = 0
    fields: Mapping[str, str] = field(default_factory=dict)    # SamplingParams' names -> the request's
    prompts: list[Prompt] = field(default_factory=list)         # completions: every prompt of the batch
    echo: bool = False                    # completions: the prompt comes back before the completion
    prompt_logprobs: int | None = None    # vLLM's prompt_logprobs field: the choices carry them



def _number(body: Mapping[str, Any], name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(name, f"must be a number, got {v!r}")
    try:
        f = float(v)
    except OverflowError:                   # an integer beyond float's range
        f = math.inf
    if not math.isfinite(f):
        raise bad(name, f"must be a finite number, got {v!r}")
    return f


def _int(body: Mapping[str, Any], name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(name, f"must be an integer, got {v!r}")
    return v


def _bool(body: Mapping[str, Any], name: str, default: bool = False, within: str = "") -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(within + name, f"must be true or false, got {v!r}")
    return v


def _given(body: Mapping[str, Any], name: str, default: Any) -> Any:
    v = body.get(name)
    return default if v is None else v


def parse_request(body: Any, chat: bool, defaults: Mapping[str, Any], limits: Limits, max_prompts: int = 64
                  ) -> Parsed:
    """max_prompts: the most prompts one completions request may batch (--max-prompts-per-request)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    echo = _bool(body, "echo")
    if echo and chat:
        raise bad("echo", "is supported on /v1/completions only")
    if echo and _bool(body, "stream"):
        raise bad("echo", "is not supported with stream: true")
    vllm_prompt_lps = _int(body, "prompt_logprobs")
    if vllm_prompt_lps is not None:
        if chat:
            raise bad("prompt_logprobs", "is supported on /v1/completions only")
        if not 0 <= vllm_prompt_lps <= limits.max_top_logprobs:
            raise bad("prompt_logprobs", f"must be in [0, {limits.max_top_logprobs}], got {vllm_prompt_lps}")
    for name, ok in (("best_of", lambda v: v in (None, 1)), ("suffix", lambda v: not v), ("tools", lambda v: not v)):
        if name in body and not ok(body[name]):
            raise bad(name, "is not supported by this server")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad("user", "must be a string")
    if "chat_template" in body:
        raise bad("chat_template", "templates come from the model (or --chat-template), never from a request")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad("messages", "must be a non-empty list of {role, content} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise bad(f"messages[{i}]", "must be an object with a string role")
            content = m.get("content")
            if content is not None and not isinstance(content, (str, list)):
                raise bad(f"messages[{i}].content", "must be a string or a list of text parts")
        prompt, prompts = None, []
    else:
        messages = None
        prompts = _prompts(body.get("prompt"), max_prompts)
        prompt = prompts[0]
    max_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, max_name)
    if max_tokens is None:
        max_tokens = min(limits.max_tokens, 16 if not chat else limits.max_tokens)
    if not (1 if not echo else 0) <= max_tokens <= limits.max_tokens:
        raise bad(max_name, f"must be in [1, {limits.max_tokens}] ([0, ...] with echo: true), got {max_tokens}")
    n = _int(body, "n")
    n = 1 if n is None else n
    if not 1 <= n <= MAX_N:
        raise bad("n", f"must be in [1, {MAX_N}], got {n}")
    most = max(MAX_N, max_prompts)
    if not chat and len(prompts) * n > most:
        raise bad("n", f"{len(prompts)} prompts x n={n} is {len(prompts) * n} choices, over this server's {most}")
    stop = body.get("stop")
    stops: tuple[str, ...] = ()
    if stop is not None:
        stops = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else ()
        if not isinstance(stop, (str, list)) or not all(isinstance(s, str) for s in stops):
            raise bad("stop", "must be a string or a list of strings")
        if len(stops) > limits.max_stops or any(len(s) > limits.max_stop_chars for s in stops):
            raise bad("stop", f"at most {limits.max_stops} stops of at most {limits.max_stop_chars} characters")
    bias = body.get("logit_bias")
    logit_bias = None
    if bias is not None:
        if not isinstance(bias, dict) or len(bias) > limits.max_logit_bias:
            raise bad("logit_bias", f"must be an object of at most {limits.max_logit_bias} token ids")
        logit_bias = {}
        for k, v in bias.items():
            try:
                tok = int(k)
            except (TypeError, ValueError):
                raise bad("logit_bias", f"key {k!r} is not a token id") from None
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
                raise bad("logit_bias", f"bias for {k} must be in [-100, 100], got {v!r}")
            logit_bias[tok] = float(v)
    top_logprobs = 0
    logprobs: int | None = None
    if chat:
        if _bool(body, "logprobs"):
            top_logprobs = _int(body, "top_logprobs") or 0
            if not 0 <= top_logprobs <= limits.max_top_logprobs:
                raise bad("top_logprobs", f"must be in [0, {limits.max_top_logprobs}]")
            logprobs = top_logprobs
        elif body.get("top_logprobs"):
            raise bad("top_logprobs", "needs logprobs: true")
    else:
        lp = _int(body, "logprobs")
        if lp is not None:
            if not 0 <= lp <= min(5, limits.max_top_logprobs):
                raise bad("logprobs", "must be in [0, 5] for completions")
            logprobs, top_logprobs = lp, lp
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad("stream_options", "must be an object")
    include_usage = _bool(opts or {}, "include_usage", within="stream_options.")
    stream = _bool(body, "stream")
    timeout = _number(body, "timeout")
    first = _number(body, "first_token_timeout")
    for name, v in (("timeout", timeout), ("first_token_timeout", first)):
        if v is not None and v <= 0:
            raise bad(name, "must be > 0 seconds")
    cap = limits.max_request_seconds
    if cap is not None:
        timeout = cap if timeout is None else min(timeout, cap)
        first = None if first is None else min(first, cap)
    on_disconnect = body.get("on_disconnect")
    if on_disconnect not in (None, "cancel", "continue"):
        raise bad("on_disconnect", 'must be "cancel" or "continue"')
    sampling: dict[str, Any] = {}
    for name in SAMPLING_FIELDS:
        v = _int(body, name) if name in ("top_k", "seed") else _number(body, name)
        if v is None:
            v = defaults.get(name)
        if v is not None:
            sampling[name] = v
    sampling.setdefault("temperature", 1.0)
    if sampling.get("top_k") == -1:
        sampling["top_k"] = 0                     # vLLM's "disabled"
    structured = structured_output(body)
    # the engine's prompt logprobs: echoed with logprobs N, asked by vLLM's field, or all that
    # max_tokens 0 with echo computes (it still runs the prefill)
    asked = [v for v in (logprobs if echo else None, vllm_prompt_lps) if v is not None]
    prompt_logprobs = max(asked) if asked else 0 if echo and max_tokens == 0 else None
    fields = {"prompt": "messages" if chat else "prompt", "max_tokens": max_name, "deadline_s": "timeout",
              "first_token_timeout_s": "first_token_timeout",
              "structured_output": "structured_outputs" if body.get("response_format") is None else "response_format"}
    try:
        params = SamplingParams(structured_output=structured,
            max_tokens=max_tokens, stop=stops, stop_token_ids=_given(body, "stop_token_ids", ()),
            ignore_eos=_bool(body, "ignore_eos"), min_tokens=_int(body, "min_tokens") or 0,
            logit_bias=logit_bias, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            deadline_s=timeout, first_token_timeout_s=first,
            skip_special_tokens=_bool(body, "skip_special_tokens", True),
            include_stop_str_in_output=_bool(body, "include_stop_str_in_output"), **sampling)
    except InvalidRequestError as e:
        raise invalid(e, fields) from None
    return Parsed(prompt, messages, params, stream, include_usage, n, first,
                  on_disconnect, top_logprobs, fields, prompts, echo, vllm_prompt_lps)


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def _prompts(value: Any, most: int) -> list[Prompt]:
    """A completions request's prompts: a string, a list of token ids, or a batch (a list of
    strings or of token-id lists, at most `most`); a batch of one is that one prompt."""
    if isinstance(value, str) and value or _token_ids(value):
        return [value]
    if not isinstance(value, list) or not value or not all(isinstance(p, (str, list)) for p in value):
        raise bad("prompt", "must be a non-empty string, a list of token ids, or a list of them (a batch)")
    if len(value) > most:
        raise bad("prompt", f"at most {most} prompts per request, got {len(value)}")
    for i, p in enumerate(value):
        if not (isinstance(p, str) and p or _token_ids(p)):
            raise bad("prompt", f"prompt[{i}] must be a non-empty string or a non-empty list of token ids")
    return list(value)


def structured_output(body: Mapping[str, Any]) -> Any:
    """OpenAI's response_format ({"type": "json_schema" | "json_object" | "text"}) or vLLM's
    structured_outputs ({"json" | "regex" | "choice" | "grammar": ...}) as a StructuredOutput."""
    from ..structured import StructuredOutput
    rf, so = body.get("response_format"), body.get("structured_outputs")
    if rf is not None and so is not None:
        raise bad("response_format", "give response_format or structured_outputs, not both")
    try:
        if rf is not None:
            if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
                raise bad("response_format", 'type must be "text", "json_object" or "json_schema"')
            if rf["type"] == "text":
                return None
            if rf["type"] == "json_object":
                return StructuredOutput(json_object=True)
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
                raise bad("response_format", "json_schema.schema must be a JSON schema object")
            return StructuredOutput(json_schema=spec["schema"])
        if so is not None:
            if not isinstance(so, dict):
                raise bad("structured_outputs", "must be an object")
            names = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "ebnf"}
            given = {names[k]: v for k, v in so.items() if k in names and v is not None}
            if isinstance(given.get("json_schema"), str):     # a schema as JSON text is JSON: the body's checks
                from .jsonbody import load
                given["json_schema"] = load(given["json_schema"], "structured_outputs.json")
            if _bool(so, "json_object", within="structured_outputs."):
                given["json_object"] = True
            return StructuredOutput(**given)
    except InvalidRequestError as e:
        raise ApiError(400, str(e), param="response_format" if rf is not None else "structured_outputs",
                       code="invalid_value") from None
    except TypeError as e:
        raise bad("structured_outputs", str(e)) from None
    return None


def invalid(e: InvalidRequestError, fields: Mapping[str, str]) -> ApiError:
    """The engine's own validation as a 400 naming the request's field (the engine says
    `SamplingParams.<name>: ...`; `fields` maps its names to the request's where they differ)."""
    msg = str(e)
    param = None
    if "SamplingParams." in msg:
        param = re.split(r"\W", msg.split("SamplingParams.", 1)[1], maxsplit=1)[0]
    elif "prompt" in msg:
        param = "prompt"
    if param is not None:
        param = fields.get(param, param)
    return ApiError(400, msg, param=param, code="invalid_value")


def finish_reason(reason: FinishReason | None) -> str | None:
    if reason is None:
        return None
    return OPENAI_FINISH.get(reason, reason.value)


def usage_body(u: Usage) -> dict[str, Any]:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.returned_tokens,
            "total_tokens": u.prompt_tokens + u.returned_tokens, "selected_tokens": u.selected_tokens,
            "processed_tokens": u.processed_tokens,
            "prompt_tokens_details": {"cached_tokens": getattr(u, "cached_tokens", 0)}}


def now() -> int:
    return int(time.time())


def stop_reason(out_stop: object) -> Any:
    if isinstance(out_stop, tuple):
        return list(out_stop)
    return out_stop


def completion_choice(index: int, out: RequestOutput, text: str, logprobs: Any) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(out.finish_reason),
            "stop_reason": stop_reason(out.stop_reason),
            "pagedecode_finish_reason": out.finish_reason.value if out.finish_reason else None}


def chat_choice(index: int, out: RequestOutput, text: str, logprobs: Any) -> dict[str, Any]:
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
            "finish_reason": finish_reason(out.finish_reason), "stop_reason": stop_reason(out.stop_reason),
            "pagedecode_finish_reason": out.finish_reason.value if out.finish_reason else None}
