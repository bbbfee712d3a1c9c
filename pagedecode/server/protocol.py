"""OpenAI-compatible request parsing: a JSON body into (prompts or messages, SamplingParams,
the reply's options), or an ApiError naming the field.

Parsing runs the request-field table (request_fields.py FIELDS: each entry names one request
field, the endpoints that read it, and what reading it does), then the rules that join fields
(`_conclude`): echo with stream, the choices' cap, logprobs, defaults, the timeouts' cap, tools
and constraints, and SamplingParams itself. The engine's own validation (InvalidRequestError)
becomes the same 400, naming the field as the request spelled it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ..errors import InvalidRequestError
from ..params import SamplingParams, is_int, is_real
from ..tools import (GENERIC, ToolFormat, ToolLimits, ToolSpec, parse_tool_fields, prepare_messages, template_kwargs,
                     tool_constraint)
from .constraints import structured_output
from .errors import ApiError, bad
from .request_fields import FIELDS, MAX_N, Draft, Limits, Prompt, checked, invalid


@dataclass
class Parsed:
    prompt: Prompt | None                 # the first (or only) prompt; chat: None
    messages: list[dict[str, Any]] | None
    params: SamplingParams
    sse: bool                             # the request's stream: true (the answer is server-sent events)
    include_usage: bool
    n: int
    first_token_timeout: float | None
    on_disconnect: str | None
    top_logprobs: int = 0
    fields: Mapping[str, str] = field(default_factory=dict)    # SamplingParams' names -> the request's
    prompts: list[Prompt] = field(default_factory=list)         # completions: every prompt of the batch
    echo: bool = False                    # completions: the prompt comes back before the completion
    prompt_logprobs: int | None = None    # vLLM's prompt_logprobs field: the choices carry them
    tools: ToolSpec | None = None         # chat: the request's tools (None: it has none)
    tool_format: ToolFormat | None = None   # how the output's calls are parsed (None: they are not)
    template_extra: dict[str, Any] = field(default_factory=dict)   # more chat template variables (`tools`)
    add_generation_prompt: bool = True    # chat: the template opens the assistant's turn ...
    continue_final_message: bool = False  # ... or continues the last message (chat.continued)


# the sampling fields a model's generation_config.json may default (serve.generation_defaults)
DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "seed")


def parse_request(body: Any, chat: bool, defaults: Mapping[str, Any], limits: Limits, max_prompts: int = 64,
                  tool_format: ToolFormat = GENERIC) -> Parsed:
    """max_prompts: the most prompts one completions request may batch (--max-prompts-per-request);
    tool_format: how the model writes tool calls (the server's, from its chat template)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    d = Draft(chat, limits, max_prompts)
    endpoint = "chat" if chat else "completions"
    if "chat_template" in body:              # even null
        raise bad("chat_template", "templates come from the model (or --chat-template), never from a request")
    for f in FIELDS:
        if endpoint in f.on:
            value = body.get(f.name)
            if value is not None or f.required:
                f.read(value, d)
    return _conclude(body, d, defaults, tool_format)


def _tools(body: Mapping[str, Any], d: Draft, fmt: ToolFormat) -> tuple[ToolSpec | None, dict[str, Any]]:
    """A chat's tools (tools/spec.py), its history's tool turns prepared for the template
    (d.messages), and the template's extra variables; a 400 naming the field."""
    if not d.chat:
        return None, {}
    try:
        spec, messages, extra = chat_template_inputs(body, d.messages or [], fmt)
    except InvalidRequestError as e:
        raise invalid(e, {}) from None
    if d.messages is not None:
        d.messages = messages
    if spec is not None and spec.calls_possible and structured_output(body) is not None:
        raise bad("tool_choice", "tools that may be called and response_format / structured_outputs together "
                                 'are not supported: send tool_choice "none", or no constraint')
    return spec, extra


def chat_template_inputs(body: Mapping[str, Any], messages: list[dict[str, Any]], fmt: ToolFormat
                         ) -> tuple[ToolSpec | None, list[dict[str, Any]], dict[str, Any]]:
    """What a chat's template is given besides its messages' text: the request's tools read, its
    history prepared (tool turns, ids, the generic format's instructions) and the template's
    extra variables (`tools`). The server renders with these, and the Ray router keys the
    prompt's pages with them (ray/router.py), so requests that differ in tools differ in keys.
    InvalidRequestError naming the field."""
    spec = parse_tool_fields(body, ToolLimits())
    return spec, prepare_messages([_null_content(m) for m in messages], spec, fmt), template_kwargs(spec, fmt)


def _null_content(m: dict[str, Any]) -> dict[str, Any]:
    """An assistant turn that only called tools has content null: the template gets "" (many
    templates concatenate it)."""
    return {**m, "content": ""} if m.get("content") is None and m.get("role") == "assistant" else m


def _conclude(body: Mapping[str, Any], d: Draft, defaults: Mapping[str, Any], fmt: ToolFormat = GENERIC) -> Parsed:
    """The rules that join fields, then SamplingParams (every type and range) and the caps that
    need its checked values."""
    if d.echo and d.sse:
        raise bad("echo", "is not supported with stream: true")
    most, choices = max(MAX_N, d.max_prompts), len(d.prompts) * d.n
    if not d.chat and choices > most:
        raise bad("n", f"{len(d.prompts)} prompts x n={d.n} is {choices} choices, over this server's {most}")
    top_logprobs, logprobs = _logprobs(d)
    sampling = {**{k: defaults[k] for k in DEFAULTED if defaults.get(k) is not None}, **d.sampling}
    sampling.setdefault("temperature", 1.0)
    if is_int(sampling.get("top_k")) and sampling["top_k"] == -1:
        sampling["top_k"] = 0                     # vLLM's "disabled"
    sampling.setdefault("max_tokens", min(d.limits.max_tokens, 16 if not d.chat else d.limits.max_tokens))
    d.fields.setdefault("max_tokens", "max_tokens")
    _cap_seconds(sampling, d.limits.max_request_seconds)
    tools, extra = _tools(body, d, fmt)
    structured = structured_output(body) if tools is None or not tools.calls_possible else tool_constraint(tools, fmt)
    # the engine's prompt logprobs: echoed with logprobs N, asked by vLLM's field, or all that
    # max_tokens 0 with echo computes (it still runs the prefill)
    asked = [v for v in (logprobs if d.echo else None, d.vllm_prompt_logprobs) if v is not None]
    prompt_logprobs = max(asked) if asked else 0 if d.echo and sampling["max_tokens"] == 0 else None
    fields = {**d.fields, "prompt": "messages" if d.chat else "prompt", "logprobs": "top_logprobs" if d.chat
              else "logprobs",
              "structured_output": "tools" if tools is not None and tools.calls_possible
              else "structured_outputs" if body.get("response_format") is None else "response_format"}
    try:
        params = SamplingParams(structured_output=structured, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                **sampling)
    except InvalidRequestError as e:
        raise invalid(e, fields) from None
    return Parsed(d.prompts[0] if d.prompts else None, d.messages, params, d.sse, d.include_usage, d.n,
                  params.first_token_timeout_s,
                  d.on_disconnect, top_logprobs, fields, d.prompts, d.echo, d.vllm_prompt_logprobs, tools,
                  fmt if tools is not None and tools.calls_possible else None, extra, d.add_generation_prompt,
                  d.continue_final_message)


def _logprobs(d: Draft) -> tuple[int, int | None]:
    """(top logprobs per token, SamplingParams.logprobs): chat's logprobs: true with
    top_logprobs N, or completions' logprobs N."""
    if not d.chat:
        return (d.logprobs or 0), d.logprobs
    if not d.wants_logprobs:
        if d.top_logprobs:
            raise bad("top_logprobs", "needs logprobs: true")
        return 0, None
    top = checked("top_logprobs", "logprobs", d.top_logprobs or 0)
    if top > d.limits.max_top_logprobs:
        raise bad("top_logprobs", f"must be in [0, {d.limits.max_top_logprobs}]")
    return top, top


def _cap_seconds(sampling: dict[str, Any], cap: float | None) -> None:
    """--max-request-seconds bounds both timeouts (a request without a timeout gets the cap).
    A value that is no number stays as given, for SamplingParams to refuse."""
    if cap is None:
        return
    deadline: Any = sampling.get("deadline_s")
    first: Any = sampling.get("first_token_timeout_s")
    sampling["deadline_s"] = cap if deadline is None else min(deadline, cap) if is_real(deadline) else deadline
    if is_real(first):
        sampling["first_token_timeout_s"] = min(first, cap)
