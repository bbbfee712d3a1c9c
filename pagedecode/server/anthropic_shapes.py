"""Anthropic's Messages API as pure functions over the shapes the server already handles: a
Messages request becomes an OpenAI-style chat request dict (system, content blocks, tool_use /
tool_result turns, tools and tool_choice); a parsed result becomes a Message; a stream's deltas
(pagedecode.tools) become Anthropic's server-sent events; an error gets Anthropic's shape.

    message_start, then per block: content_block_start, content_block_delta (text_delta or
    input_json_delta)..., content_block_stop; then message_delta (stop_reason, usage) and
    message_stop; ping whenever the server wants to keep the line alive.
"""
from __future__ import annotations

import json
from typing import Any, Mapping

from ..errors import InvalidFieldError
from ..tools.calls import ContentDelta, Delta, ToolCallDelta, ToolCallEnd, ToolOutput
from .errors import ApiError

SAMPLED = ("temperature", "top_p", "top_k")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               529: "overloaded_error"}


def _bad(field: str, reason: str) -> InvalidFieldError:
    return InvalidFieldError("request", field, reason)


# -- request -----------------------------------------------------------------------------------
def chat_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """A Messages request as the chat completions request it asks for (InvalidFieldError naming
    the Anthropic field otherwise). Fields are checked here only as far as converting needs;
    the chat parser checks values (ranges, types) as for any chat request."""
    if not isinstance(body, Mapping):
        raise _bad("body", "must be a JSON object")
    if body.get("max_tokens") is None:
        raise _bad("max_tokens", "is required")
    thinking = body.get("thinking")
    if thinking is not None and not (isinstance(thinking, dict) and thinking.get("type") == "disabled"):
        raise _bad("thinking", "extended thinking is not supported")
    out: dict[str, Any] = {"model": body.get("model"), "max_tokens": body["max_tokens"],
                           "messages": _system(body.get("system")) + _messages(body.get("messages"))}
    out.update(_prefill(out["messages"], len(body["messages"]) - 1))
    for name in SAMPLED:
        if body.get(name) is not None:
            out[name] = body[name]
    if body.get("stop_sequences") is not None:
        out["stop"] = body["stop_sequences"]
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise _bad("metadata", "must be an object")
        if isinstance(metadata.get("user_id"), str):
            out["user"] = metadata["user_id"]
    if body.get("stream") is not None:
        out["stream"] = body["stream"]
        out["stream_options"] = {"include_usage": True}
    if body.get("tools"):
        out["tools"] = [_tool(t, i) for i, t in enumerate(_list(body["tools"], "tools"))]
    if body.get("tool_choice") is not None:
        out.update(_tool_choice(body["tool_choice"]))
    return out


def _list(value: Any, field: str) -> list[Any]:
    if not isinstance(value, list):
        raise _bad(field, "must be a list")
    return value


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    return [{"role": "system", "content": "".join(_text_block(b, f"system[{i}]")
                                                 for i, b in enumerate(_list(system, "system")))}]


def _text_block(block: Any, field: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        raise _bad(field, 'must be a text block {"type": "text", "text": ...}')
    return str(block["text"])


def _messages(messages: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, m in enumerate(_list(messages, "messages")):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise _bad(f"messages[{i}].role", 'must be "user" or "assistant"')
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        text, calls, results = [], [], []
        for j, b in enumerate(_list(content, f"messages[{i}].content")):
            where = f"messages[{i}].content[{j}]"
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                text.append(_text_block(b, where))
            elif kind == "tool_use" and m["role"] == "assistant":
                if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                    raise _bad(where, "a tool_use block needs id and name")
                calls.append({"id": b["id"], "type": "function",
                              "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}))}})
            elif kind == "tool_result" and m["role"] == "user":
                if not isinstance(b.get("tool_use_id"), str):
                    raise _bad(f"{where}.tool_use_id", "must be the id of the tool_use it answers")
                results.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                                "content": _result_text(b.get("content"), f"{where}.content")})
            else:
                raise _bad(f"{where}.type", f"{kind!r} blocks are not supported in {m['role']} messages")
        out += results                      # a tool's answer comes before the user's words after it
        if calls:
            out.append({"role": "assistant", "content": "".join(text) or None, "tool_calls": calls})
        elif text or not results:
            out.append({"role": m["role"], "content": "".join(text)})
    return out


def _prefill(messages: list[dict[str, Any]], final: int) -> dict[str, Any]:
    """A final assistant message is the answer begun (Anthropic's prefill): the output continues
    it, and holds only what follows (the chat request's continue_final_message). An empty one is
    no prefill (dropped from messages); one that ends in whitespace is refused, as Anthropic refuses it. final: its index in
    the request's messages."""
    last = messages[-1] if messages else {}
    if last.get("role") != "assistant" or last.get("tool_calls"):
        return {}
    if not last.get("content"):
        messages.pop()
        return {}
    if last["content"] != last["content"].rstrip():
        raise _bad(f"messages[{final}].content", "final assistant content cannot end with trailing "
                   "whitespace")
    return {"continue_final_message": True, "add_generation_prompt": False}


def _result_text(content: Any, field: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(_text_block(b, f"{field}[{k}]") for k, b in enumerate(_list(content, field)))


def _tool(tool: Any, i: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
        raise _bad(f"tools[{i}]", "only custom tools {name, description, input_schema} are supported")
    fn = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def _tool_choice(choice: Any) -> dict[str, Any]:
    kind = choice.get("type") if isinstance(choice, dict) else None
    names = {"auto": "auto", "any": "required", "none": "none"}
    if kind in names:
        out: dict[str, Any] = {"tool_choice": names[kind]}
    elif kind == "tool" and isinstance(choice.get("name"), str):
        out = {"tool_choice": {"type": "function", "function": {"name": choice["name"]}}}
    else:
        raise _bad("tool_choice", 'must be {"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}')
    if choice.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False
    return out


# -- response ----------------------------------------------------------------------------------
def stop_reason(engine_reason: str, output: ToolOutput) -> str:
    """Anthropic's stop_reason from the engine's FinishReason value and what was parsed."""
    if engine_reason in ("max_output_tokens", "context_limit"):
        return "max_tokens"
    if output.calls and output.complete:
        return "tool_use"
    return "stop_sequence" if engine_reason == "stop_sequence" else "end_turn"


def content_blocks(output: ToolOutput) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": output.content}] if output.content else []
    for call in output.calls:
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": _input(call.arguments)})
    return blocks


def _input(arguments: str) -> Any:
    """A call's input: its arguments parsed (a cut call's text, unparsed, becomes {})."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def message(message_id: str, model: str, output: ToolOutput, engine_reason: str, stop_sequence: str | None,
            input_tokens: int, output_tokens: int) -> dict[str, Any]:
    """The whole reply (a non-streamed request)."""
    reason = stop_reason(engine_reason, output)
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": content_blocks(output), "stop_reason": reason,
            "stop_sequence": stop_sequence if reason == "stop_sequence" else None,
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}}


def error(status: int, text: str) -> dict[str, Any]:
    """Anthropic's error body for an HTTP status."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": text}}


class MessageEvents:
    """One streamed reply's events, from the tool parser's deltas: the blocks open and close
    in order (text, then each call as a tool_use block)."""

    def __init__(self, message_id: str, model: str, input_tokens: int) -> None:
        self.message_id, self.model, self.input_tokens = message_id, model, input_tokens
        self.blocks = 0                  # blocks started
        self.open: str | None = None     # the open block's kind ("text" / "tool_use"), or None

    def start(self) -> list[dict[str, Any]]:
        return [{"type": "message_start", "message": {
            "id": self.message_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}}]

    def feed(self, deltas: list[Delta]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for d in deltas:
            if isinstance(d, ContentDelta):
                if self.open != "text":
                    events += self._open({"type": "text", "text": ""})
                events.append(self._delta({"type": "text_delta", "text": d.text}))
            elif isinstance(d, ToolCallDelta) and d.id is not None:
                events += self._open({"type": "tool_use", "id": d.id, "name": d.name, "input": {}})
            elif isinstance(d, ToolCallDelta):
                if d.arguments:
                    events.append(self._delta({"type": "input_json_delta", "partial_json": d.arguments}))
            elif isinstance(d, ToolCallEnd):
                events += self._close()
        return events

    def finish(self, engine_reason: str, output: ToolOutput, stop_sequence: str | None,
               output_tokens: int) -> list[dict[str, Any]]:
        reason = stop_reason(engine_reason, output)
        return self._close() + [
            {"type": "message_delta", "delta": {"stop_reason": reason,
                                                "stop_sequence": stop_sequence if reason == "stop_sequence" else None},
             "usage": {"output_tokens": output_tokens}},
            {"type": "message_stop"}]

    def _open(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        self.open = block["type"]
        self.blocks += 1
        return events + [{"type": "content_block_start", "index": self.blocks - 1, "content_block": block}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}

    def _close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.blocks - 1}]


PING: dict[str, Any] = {"type": "ping"}


def sse(event: Mapping[str, Any]) -> str:
    """An event as server-sent event text (Anthropic names each event by its type)."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


# -- errors of the chat path, under the Messages API's names ---------------------------------------
FIELD_NAMES = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences"}   # chat's -> the Messages API's


def renamed(e: ApiError) -> ApiError:
    """An ApiError naming a chat field, renamed to the Messages API's (`stop` -> `stop_sequences`,
    `tools[i].function.parameters` -> `tools[i].input_schema`, ...)."""
    if e.param is None:
        return e
    ours = FIELD_NAMES.get(e.param, e.param.replace(".function.parameters", ".input_schema").replace(".function.", "."))
    return ApiError(e.status, e.message.replace(e.param, ours), ours, e.code, e.type, e.headers)


def api_error(e: ApiError) -> dict[str, Any]:
    """An ApiError in Anthropic's shape: the field in error named in the message."""
    e = renamed(e)
    return error(e.status, e.message if e.param is None or e.param in e.message else f"{e.param}: {e.message}")
