"""Tool calls in OpenAI's chat completion shapes: a message's `tool_calls`, a stream's
`delta.tool_calls`, and the finish reason that agrees with them (tools/finish.py).

A call's id is made from its request's id and its index, so the body, the stream, a resumed
stream and an Idempotency-Key replay all name the same call alike; in the form the model's
template takes back (Mistral's: 9 letters and digits, ToolFormat.id_length).
"""
from __future__ import annotations

import hashlib
import itertools
from typing import Any, Callable

from ..tools import (ContentDelta, Delta, ToolCall, ToolCallDelta, ToolFormat, ToolOutput, ToolStreamParser,
                     parse_tool_output, tool_finish_reason)
from ..tools.calls import digest_id


def call_ids(request_id: str, prefix: str = "call_", length: int | None = None) -> Callable[[], str]:
    """The ids of a request's calls in order, from (request id, index): prefix and 24 hex digits,
    or exactly `length` letters and digits (a template's rule, ToolFormat.id_length)."""
    counter = itertools.count()
    if length is not None:
        return lambda: digest_id(f"{request_id}:{next(counter)}", length)
    return lambda: prefix + hashlib.sha256(f"{request_id}:{next(counter)}".encode()).hexdigest()[:24]


def parsed_output(text: str, fmt: ToolFormat, request_id: str, prefix: str = "call_") -> ToolOutput:
    return parse_tool_output(text, fmt, call_ids(request_id, prefix, fmt.id_length))


def tool_call_body(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def message_body(output: ToolOutput) -> dict[str, Any]:
    """The assistant message: content null when it only called tools (OpenAI's shape)."""
    message: dict[str, Any] = {"role": "assistant", "content": output.content or (None if output.calls else "")}
    if output.calls:
        message["tool_calls"] = [tool_call_body(c) for c in output.calls]
    return message


def delta_body(deltas: list[Delta]) -> dict[str, Any]:
    """One chunk's `delta` for what the parser made known: its content, and each call's first
    delta with index, id, type and name (arguments ""), then arguments text by index."""
    delta: dict[str, Any] = {}
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    if content:
        delta["content"] = content
    calls = []
    for d in deltas:
        if not isinstance(d, ToolCallDelta):
            continue
        if d.id is not None:
            calls.append({"index": d.index, "id": d.id, "type": "function",
                          "function": {"name": d.name, "arguments": d.arguments}})
        else:
            calls.append({"index": d.index, "function": {"arguments": d.arguments}})
    if calls:
        delta["tool_calls"] = calls
    return delta


class ToolChoiceStream:
    """One streamed choice's tool calls: its text deltas in, OpenAI's delta fields out."""

    def __init__(self, fmt: ToolFormat, request_id: str, prefix: str = "call_") -> None:
        self.parser = ToolStreamParser(fmt, call_ids(request_id, prefix, fmt.id_length))

    def feed(self, text: str) -> dict[str, Any]:
        return delta_body(self.parser.feed(text))

    def finish(self) -> dict[str, Any]:
        """The text held back at the end (the finish chunk's delta)."""
        return delta_body(self.parser.finish())

    def finish_reason(self, reason: str | None) -> str | None:
        return None if reason is None else tool_finish_reason(self.parser.output, reason)
