"""The Responses API's function tools: a tool-calling response's output items (a `message` for
its text, a `function_call` with its `call_id` for each call) and the stream events that build
them, from the tool parser's deltas:

    text                output_item.added (message), content_part.added, output_text.delta ...
    a call begins       (the open message's output_text.done, content_part.done, output_item.done)
                        output_item.added (function_call, arguments "")
    its arguments       response.function_call_arguments.delta ...
    its end             response.function_call_arguments.done, output_item.done

Call ids come from the response id and the call's index (tool_calls.call_ids), so a resumed
stream and GET /v1/responses/{id} name the same calls.
"""
from __future__ import annotations

from typing import Any

from ..tools import ContentDelta, Delta, ToolCall, ToolCallDelta, ToolCallEnd, ToolFormat, ToolOutput
from .tool_calls import ToolChoiceStream, parsed_output


def message_item(rid: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": "msg_" + rid.removeprefix("resp_"), "status": status, "role": "assistant",
            "content": [output_text(text)]}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def item_ids(rid: str, index: int) -> tuple[str, str]:
    """(the function_call item's id, its call_id) of a response's call `index`."""
    suffix = f"{rid.removeprefix('resp_')}_{index}"
    return "fc_" + suffix, "call_" + suffix


def function_call_item(rid: str, index: int, call: ToolCall, status: str) -> dict[str, Any]:
    item_id, call_id = item_ids(rid, index)
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": call.name,
            "arguments": call.arguments, "status": status}


def output_items(rid: str, text: str, fmt: ToolFormat, status: str) -> list[dict[str, Any]]:
    """A tool-calling response's output: its text as a message (when it has any), then its calls."""
    output = parsed_output(text, fmt, rid)
    items = [message_item(rid, output.content, status)] if output.content else []
    done = "completed" if status == "completed" else "incomplete"
    return items + [function_call_item(rid, i, c, done if c.complete else "incomplete")
                    for i, c in enumerate(output.calls)]


class ToolItemEvents:
    """One response stream's items and events, as the text arrives (fed in order, once)."""

    def __init__(self, rid: str, fmt: ToolFormat) -> None:
        self.rid = rid
        self.tools = ToolChoiceStream(fmt, rid)
        self.output = ToolOutput()
        self.index = -1                       # the open item's output_index
        self.message_open = False
        self.text = ""                        # the open message's text

    def feed(self, text: str | None) -> list[dict[str, Any]]:
        """The events this text makes (None: the end of the text)."""
        parser = self.tools.parser
        deltas = parser.feed(text) if text is not None else parser.finish()
        events: list[dict[str, Any]] = []
        for d in deltas:
            self.output.apply(d)
            events += self._delta(d)
        if text is None:
            events += self._close_message()
        return events

    def _delta(self, d: Delta) -> list[dict[str, Any]]:
        item_id = "msg_" + self.rid.removeprefix("resp_")
        if isinstance(d, ContentDelta):
            events = []
            if not self.message_open:
                self.index += 1
                self.message_open, self.text = True, ""
                events += [{"type": "response.output_item.added", "output_index": self.index,
                            "item": {**message_item(self.rid, "", "in_progress"), "content": []}},
                           {"type": "response.content_part.added", "item_id": item_id, "output_index": self.index,
                            "content_index": 0, "part": output_text("")}]
            self.text += d.text
            return events + [{"type": "response.output_text.delta", "item_id": item_id, "output_index": self.index,
                              "content_index": 0, "delta": d.text, "logprobs": []}]
        if isinstance(d, ToolCallDelta) and d.id is not None:
            events = self._close_message()
            self.index += 1
            item = function_call_item(self.rid, d.index, self.output.calls[d.index], "in_progress")
            return events + [{"type": "response.output_item.added", "output_index": self.index, "item": item}]
        fc_id, _ = item_ids(self.rid, d.index)
        if isinstance(d, ToolCallDelta):
            return [{"type": "response.function_call_arguments.delta", "item_id": fc_id,
                     "output_index": self.index, "delta": d.arguments}] if d.arguments else []
        assert isinstance(d, ToolCallEnd)
        call = self.output.calls[d.index]
        return [{"type": "response.function_call_arguments.done", "item_id": fc_id, "output_index": self.index,
                 "arguments": call.arguments},
                {"type": "response.output_item.done", "output_index": self.index,
                 "item": function_call_item(self.rid, d.index, call, "completed")}]

    def _close_message(self) -> list[dict[str, Any]]:
        if not self.message_open:
            return []
        self.message_open = False
        item_id = "msg_" + self.rid.removeprefix("resp_")
        return [{"type": "response.output_text.done", "item_id": item_id, "output_index": self.index,
                 "content_index": 0, "text": self.text, "logprobs": []},
                {"type": "response.content_part.done", "item_id": item_id, "output_index": self.index,
                 "content_index": 0, "part": output_text(self.text)},
                {"type": "response.output_item.done", "output_index": self.index,
                 "item": message_item(self.rid, self.text, "completed")}]
