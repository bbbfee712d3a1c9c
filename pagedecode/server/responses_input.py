"""The Responses API's request body: validated, and turned into a chat body (`instructions` a
system message first, then `input`; text.format as response_format; max_output_tokens as
max_completion_tokens) that protocol.parse_request parses, so sampling, limits, the chat
template's escaping and structured output are the chat path's; errors name the Responses
field. StoredResponse keeps what the response object echoes besides its output.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from .errors import ApiError, bad
from ..tools import GENERIC, ToolFormat
from .protocol import Limits, Parsed, parse_request
from .request_fields import boolean

# the request's fields under their chat names, for parse_request; errors name the Responses field
RENAMED = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}
# pagedecode's own extras, taken as on chat
PASSED = ("seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop",
          "timeout", "first_token_timeout", "on_disconnect", "ignore_eos", "min_tokens")
# taken and not acted on (a server without tools or tiers has nothing to do with them)
IGNORED = ("user", "service_tier", "prompt_cache_key", "safety_identifier", "stream_options",
           "truncation")
UNSUPPORTED = {
    "reasoning": "reasoning (and reasoning items) is not supported by this server",
    "previous_response_id": "previous_response_id is not supported: send the conversation as input messages",
    "conversation": "conversations are not supported: send the conversation as input messages",
    "prompt": "prompt templates are not supported",
    "include": "include is not supported",
    "top_logprobs": "top_logprobs is not supported on /v1/responses (use /v1/chat/completions)",
    "max_tool_calls": "max_tool_calls is not supported (parallel_tool_calls: false gives at most one)",
}
TAKEN = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "store",
         "background", "metadata", "text", "tools", "tool_choice", "parallel_tool_calls", *PASSED, *IGNORED, *UNSUPPORTED}

@dataclass
class StoredResponse:
    """What a response object echoes besides its output, kept with its Track."""
    store: bool
    background: bool
    instructions: str | None
    metadata: dict[str, str]
    max_output_tokens: int | None
    temperature: float
    top_p: float
    tool_choice: Any
    text_json: str = '{"format": {"type": "text"}}'   # the response's `text`, kept as its compact JSON
    parallel_tool_calls: bool = True
    deleted: bool = False

    @property
    def text(self) -> dict[str, Any]:
        return json.loads(self.text_json)

    def kept_bytes(self) -> int:
        """Its size as held: the strings' bytes (a parsed object would take tens of times its JSON)."""
        return 300 + len(json.dumps([self.instructions, self.metadata])) + len(self.text_json)


# -- parsing --------------------------------------------------------------------------------------
def parse_body(body: Any, defaults: Mapping[str, Any], limits: Limits, tool_format: ToolFormat = GENERIC
               ) -> tuple[Parsed, StoredResponse]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name in body:
        if name not in TAKEN:
            raise ApiError(400, f"unknown parameter {name!r}", param=name, code="unknown_parameter")
    for name, why in UNSUPPORTED.items():
        if body.get(name) not in (None, [], {}, 0):
            raise ApiError(400, f"{name}: {why}", param=name, code="unsupported_parameter")
    if body.get("truncation") not in (None, "disabled", "auto"):
        raise bad("truncation", 'must be "disabled" or "auto"')
    store = boolean(body, "store", True)
    background = boolean(body, "background")
    if background and not store:
        raise bad("background", "background responses need store: true (the result is fetched later)")
    chat: dict[str, Any] = {"messages": messages(body), "stream": body.get("stream"),
                            "max_completion_tokens": body.get("max_output_tokens"),
                            "response_format": text_format(body.get("text"))}
    for name in ("temperature", "top_p", "parallel_tool_calls", *PASSED):
        if body.get(name) is not None:
            chat[name] = body[name]
    chat.update(nested_tools(body))
    if background:
        chat["on_disconnect"] = "continue"      # it outlives the connection that made it
    try:
        parsed = parse_request({k: v for k, v in chat.items() if v is not None}, True,
                               defaults, limits, tool_format=tool_format)
    except ApiError as e:
        raise renamed(e) from None
    p = parsed.params
    return parsed, StoredResponse(store, background, body.get("instructions"), metadata(body.get("metadata")),
                                  body.get("max_output_tokens"), p.temperature, p.top_p,
                                  body.get("tool_choice") or "auto", kept_text(body.get("text")),
                                  parallel_tool_calls=body.get("parallel_tool_calls") is not False)


def messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """`instructions` as a system message first, then `input` (a string: one user message)."""
    out: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad("instructions", "must be a string")
        out.append({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str) and given:
        return out + [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise bad("input", "must be a non-empty string or a non-empty list of messages")
    for i, item in enumerate(given):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(where, "must be a message object {role, content}")
        kind = item.get("type", "message")
        if kind in ("function_call", "function_call_output"):
            tool_turn(out, item, where)
            continue
        if kind != "message":
            raise ApiError(400, f"{where}.type: {kind!r} items are not supported (only messages and function calls)",
                           param=f"{where}.type", code="unsupported_parameter")
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise bad(f"{where}.role", f'must be "user", "assistant", "system" or "developer", got {role!r}')
        out.append({"role": "system" if role == "developer" else role,
                    "content": content_text(item.get("content"), where)})
    return out


def tool_turn(out: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    """A function_call item joins the assistant turn before it (calls in a row are one turn);
    a function_call_output is a `tool` message."""
    if not isinstance(item.get("call_id"), str):
        raise bad(f"{where}.call_id", "must be the call's id")
    if item["type"] == "function_call_output":
        output = item.get("output")
        if not isinstance(output, str):
            output = content_text(output, where)
        out.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        return
    if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments"), str):
        raise bad(where, "a function_call item needs a string name and arguments")
    call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
    if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
        out[-1]["tool_calls"].append(call)
    else:
        out.append({"role": "assistant", "content": None, "tool_calls": [call]})


def nested_tools(body: dict[str, Any]) -> dict[str, Any]:
    """The flat function tools and named choice as chat's nested ones (their errors are renamed
    back: `tools[i].parameters`)."""
    out: dict[str, Any] = {}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("tools", "must be a list of function tools")
        out["tools"] = [{"type": t.get("type"), "function": {k: v for k, v in t.items() if k != "type"}}
                        if isinstance(t, dict) else t for t in tools]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice is not None:
        out["tool_choice"] = choice
    return out


def content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where}.content", "must be a string or a list of input_text / output_text parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text") and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif kind in ("input_image", "input_file", "input_audio", "refusal"):
            raise ApiError(400, f"{where}.content[{j}]: {kind} parts are not supported (text only)",
                           param=f"{where}.content[{j}]", code="unsupported_parameter")
        else:
            raise bad(f"{where}.content[{j}]", "must be an input_text or output_text part {type, text}")
    return "".join(parts)


def text_format(text: Any) -> dict[str, Any] | None:
    """text.format as chat's response_format."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad("text", "must be an object")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise bad("text.format", 'type must be "text", "json_object" or "json_schema"')
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    if not isinstance(fmt.get("schema"), (dict, bool)):
        raise bad("text.format.schema", "must be a JSON schema object")
    return {"type": "json_schema", "json_schema": {"schema": fmt["schema"], "name": fmt.get("name"),
                                                   "strict": fmt.get("strict")}}


FORMAT_KEYS = ("type", "name", "description", "schema", "strict")


def kept_text(text: Any) -> str:
    """What a stored response keeps of the request's `text` (checked by text_format already):
    its format's own keys, as compact JSON; whatever else the object held is dropped."""
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict):
        fmt = {"type": "text"}
    return json.dumps({"format": {k: fmt[k] for k in FORMAT_KEYS if k in fmt}}, separators=(",", ":"))


def metadata(value: Any) -> dict[str, str]:
    """OpenAI's bounds: at most 16 pairs, keys up to 64 characters, values up to 512."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > 16 or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in value.items()):
        raise bad("metadata", "must be an object of at most 16 string values (keys <= 64, values <= 512 characters)")
    return dict(value)


def renamed(e: ApiError) -> ApiError:
    """An error of the chat path, naming the Responses field."""
    if e.param is not None and ".function." in e.param:
        e.message = e.message.replace(e.param, e.param.replace(".function.", "."))
        e.param = e.param.replace(".function.", ".")
    if e.param in RENAMED:
        old = e.param
        e.param = RENAMED[old]
        e.message = e.message.replace(old, e.param)
        if e.param not in e.message:
            e.message = f"{e.param}: {e.message}"
    return e
