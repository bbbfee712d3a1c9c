"""The Anthropic Messages API's shapes, as pure conversions: its request body into a chat
completions body (protocol.parse_request then parses it, so sampling, limits, the template's
escaping and the tools' constraint are the chat path's), errors renamed to its fields and put
in its error shape, an output as content blocks with its stop_reason, and a stream's tool
deltas as its content-block events.

    system                         a system message first
    messages[i].content blocks     text -> content; tool_use -> the assistant's tool_calls;
                                   tool_result -> a `tool` message (before the turn's text)
    max_tokens, stop_sequences     max_tokens, stop
    temperature, top_p, top_k      as given;  metadata.user_id: taken
    tools[i] {name, description, input_schema}          function tools
    tool_choice auto | any | tool | none (+ disable_parallel_tool_use)
                                   auto | required | named | none (+ parallel_tool_calls)
"""
from __future__ import annotations

import json
from typing import Any

from ..runtime.lifecycle import FinishReason
from ..runtime.result import RequestOutput
from ..tools import ContentDelta, Delta, ToolCallDelta, ToolCallEnd, ToolOutput
from .errors import ApiError, bad

TAKEN = {"model", "messages", "system", "max_tokens", "stop_sequences", "temperature", "top_p", "top_k", "metadata",
         "tools", "tool_choice", "stream", "service_tier"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "invalid_request_error", 409: "invalid_request_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
# chat's field names -> the Messages API's (errors name what the client sent)
RENAMES = (("max_completion_tokens", "max_tokens"), ("stop", "stop_sequences"), (".function.parameters", ".input_schema"),
           (".function.name", ".name"), (".function.description", ".description"))


# -- the request ------------------------------------------------------------------------------------
def chat_body(body: Any, count_only: bool = False) -> dict[str, Any]:
    """The chat completions body of a Messages API request (count_only: /count_tokens', which
    has no max_tokens)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name in body:
        if name not in TAKEN:
            raise bad(name, "is not a field this server takes")
    max_tokens = body.get("max_tokens")
    if max_tokens is None and not count_only:
        raise bad("max_tokens", "is required")
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict)
                                 or not isinstance(metadata.get("user_id", ""), (str, type(None)))):
        raise bad("metadata", "must be an object (user_id a string)")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad("messages", "must be a non-empty list of {role, content}")
    messages = system_messages(body.get("system"))
    for i, m in enumerate(raw):
        messages.extend(turn(m, i))
    chat: dict[str, Any] = {"messages": messages, "max_tokens": 1 if count_only else max_tokens}
    for name in ("temperature", "top_p", "top_k", "stream"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    if body.get("tools") is not None:
        chat["tools"] = tools_of(body["tools"])
    chat.update(tool_choice_of(body.get("tool_choice")))
    return chat


def system_messages(system: Any) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    if isinstance(system, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                        and isinstance(b.get("text"), str) for b in system):
        return [{"role": "system", "content": "".join(b["text"] for b in system)}]
    raise bad("system", "must be a string or a list of text blocks")


def turn(m: Any, i: int) -> list[dict[str, Any]]:
    """One Messages API turn as chat messages: a user turn's tool results come first, as `tool`
    messages, then its text; an assistant turn's tool_use blocks are its tool_calls."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise bad(f"{where}.role", 'must be "user" or "assistant"')
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": m["role"], "content": content}]
    if not isinstance(content, list):
        raise bad(f"{where}.content", "must be a string or a list of content blocks")
    text, calls, results = "", [], []
    for j, b in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            text += b["text"]
        elif kind == "tool_use" and m["role"] == "assistant":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str) or not isinstance(
                    b.get("input", {}), dict):
                raise bad(at, "a tool_use block needs a string id and name and an input object")
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}))}})
        elif kind == "tool_result" and m["role"] == "user":
            if not isinstance(b.get("tool_use_id"), str):
                raise bad(f"{at}.tool_use_id", "must be the id of the tool_use it answers")
            results.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": result_text(b, at)})
        else:
            raise bad(at, f"a {m['role']} turn's blocks are text" + (", tool_use" if m["role"] == "assistant"
                                                                     else ", tool_result") + f"; got {kind!r}")
    out: list[dict[str, Any]] = list(results)
    if m["role"] == "assistant":
        out.append({"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})})
    elif text or not results:
        out.append({"role": "user", "content": text})
    return out


def result_text(block: dict[str, Any], at: str) -> str:
    content = block.get("content", "")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        content = "".join(str(p.get("text", "")) for p in content)
    if not isinstance(content, str):
        raise bad(f"{at}.content", "must be a string or a list of text blocks")
    return ("error: " if block.get("is_error") else "") + content


def tools_of(tools: Any) -> Any:
    if not isinstance(tools, list):
        raise bad("tools", "must be a list of tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "custom") != "custom":
            raise bad(f"tools[{i}]", "only client tools {name, description, input_schema} are supported")
        fn = {"name": t.get("name"), "parameters": t.get("input_schema")}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        if t.get("input_schema") is None:
            raise bad(f"tools[{i}].input_schema", "is required")
        out.append({"type": "function", "function": fn})
    return out


def tool_choice_of(choice: Any) -> dict[str, Any]:
    if choice is None:
        return {}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise bad("tool_choice", '{"type": "auto" | "any" | "tool" | "none"}')
    out: dict[str, Any] = {"tool_choice": {"auto": "auto", "any": "required", "none": "none"}.get(kind)}
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise bad("tool_choice.name", "must name the tool")
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    if choice.get("disable_parallel_tool_use") is not None:
        out["parallel_tool_calls"] = not choice["disable_parallel_tool_use"]
    return out


def renamed(e: ApiError) -> ApiError:
    """An error naming a chat field, renamed to the Messages API's."""
    param, message = e.param, e.message
    for chat, ours in RENAMES:
        if param is not None:
            param = param.replace(chat, ours)
        message = message.replace(chat, ours)
    return ApiError(e.status, message, param, e.code, e.type, e.headers)


def error_body(e: ApiError) -> dict[str, Any]:
    """Anthropic's error shape (the field in error is in its message)."""
    kind = ERROR_TYPES.get(e.status, "api_error")
    message = e.message if e.param is None or e.param in e.message else f"{e.param}: {e.message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


# -- the answer -------------------------------------------------------------------------------------
def content_blocks(output: ToolOutput) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": output.content}] if output.content else []
    for c in output.calls:
        blocks.append({"type": "tool_use", "id": c.id, "name": c.name, "input": tool_input(c.arguments)})
    return blocks


def tool_input(arguments: str) -> Any:
    """A call's input object (a call cut short: what of it parses, else {})."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_of(out: RequestOutput, output: ToolOutput) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence)."""
    reason = out.finish_reason
    if reason in (FinishReason.MAX_OUTPUT_TOKENS, FinishReason.CONTEXT_LIMIT):
        return "max_tokens", None
    if output.calls and output.complete:
        return "tool_use", None
    if reason == FinishReason.STOP_SEQUENCE and isinstance(out.stop_reason, str):
        return "stop_sequence", out.stop_reason
    return "end_turn", None


def usage_of(out: RequestOutput) -> dict[str, Any]:
    return {"input_tokens": out.usage.prompt_tokens, "output_tokens": out.usage.returned_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": getattr(out.usage, "cached_tokens", 0)}


def message_body(message_id: str, model: str, output: ToolOutput, out: RequestOutput) -> dict[str, Any]:
    stop_reason, stop_sequence = stop_of(out, output)
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": content_blocks(output), "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": usage_of(out)}


def event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n"


class BlockEvents:
    """A stream's deltas as content-block events: a text block opens at the first text after
    a call (or at the start), a tool_use block at a call's first delta, each closes when the
    next opens, its call ends, or the stream does."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None           # the open block's kind

    def _start(self, block: dict[str, Any]) -> list[str]:
        frames = self.stop()
        self.index += 1
        self.open = block["type"]
        return frames + [event("content_block_start", {"index": self.index, "content_block": block})]

    def stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.index})]

    def frames(self, deltas: list[Delta]) -> list[str]:
        out: list[str] = []
        for d in deltas:
            if isinstance(d, ContentDelta):
                if self.open != "text":
                    out += self._start({"type": "text", "text": ""})
                out.append(event("content_block_delta", {"index": self.index,
                                                         "delta": {"type": "text_delta", "text": d.text}}))
            elif isinstance(d, ToolCallDelta) and d.id is not None:
                out += self._start({"type": "tool_use", "id": d.id, "name": d.name, "input": {}})
            elif isinstance(d, ToolCallDelta) and d.arguments:
                out.append(event("content_block_delta", {"index": self.index, "delta": {
                    "type": "input_json_delta", "partial_json": d.arguments}}))
            elif isinstance(d, ToolCallEnd):
                out += self.stop()
        return out
