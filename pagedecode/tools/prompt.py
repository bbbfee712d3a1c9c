"""What a chat template is given for a tool-calling request: the tools (as the `tools` variable,
for templates that render them; in the system message, for the generic format) and the
history's tool turns: assistant messages with `tool_calls` and `role: "tool"` results.

Templates follow Hugging Face's convention: `tools` is a list of `{"type": "function",
"function": {...}}`, an assistant's `tool_calls[i].function.arguments` is a dict (most templates
write it with `tojson`: a JSON string would be quoted twice), a tool result is `{"role": "tool",
"tool_call_id", "content"}`. A template without tool support gets plain turns instead: the
assistant's calls as the generic envelope it was asked to write, a result as a user turn. A
template that takes only ids of a fixed form (Mistral's: 9 letters and digits) gets the ids
mapped to that form, a call's and its result's alike (calls.template_call_id).
"""
from __future__ import annotations

import json
from typing import Any

from .calls import template_call_id
from .formats import ToolFormat
from .spec import ToolSpec, field_error

Message = dict[str, Any]


def template_tools(spec: ToolSpec) -> list[dict[str, Any]]:
    """The tools as the template variable `tools` (Hugging Face's shape)."""
    out = []
    for t in spec.tools:
        fn: dict[str, Any] = {"name": t.name, "parameters": t.parameters}
        if t.description is not None:
            fn["description"] = t.description
        out.append({"type": "function", "function": fn})
    return out


def template_kwargs(spec: ToolSpec | None, fmt: ToolFormat) -> dict[str, Any]:
    """Extra template variables: `tools` for a template that renders them (not under none)."""
    if spec is None or not spec.calls_possible or not fmt.native:
        return {}
    return {"tools": template_tools(spec)}


def generic_instructions(spec: ToolSpec) -> str:
    """The system text that tells a model without tool support what it may call and how."""
    tools = json.dumps(template_tools(spec), ensure_ascii=False)
    calls = '{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]}'
    if spec.mode == "auto":
        how = f'Answer with one JSON object: {calls} to call tools, or {{"response": "<your reply>"}}.'
    else:
        how = f"Answer by calling a tool, with one JSON object: {calls}."
    return f"You can call these tools:\n{tools}\n{how}"


def prepare_messages(messages: list[Message], spec: ToolSpec | None, fmt: ToolFormat) -> list[Message]:
    """The history as the template expects it (checked: a 400 naming `messages[i]...`)."""
    out = [_turn(m, i, fmt) for i, m in enumerate(messages)]
    if spec is not None and spec.calls_possible and not fmt.native:
        text = generic_instructions(spec)
        if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _turn(m: Message, i: int, fmt: ToolFormat) -> Message:
    role = m.get("role")
    if role == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str):
            raise field_error(f"messages[{i}].tool_call_id", "a tool message needs the id of the call it answers")
        if fmt.native:
            return m if fmt.id_length is None else {**m, "tool_call_id": template_call_id(call_id, fmt.id_length)}
        result = {"tool_call_id": call_id, "content": _text(m.get("content"))}
        return {"role": "user", "content": json.dumps({"tool_response": result}, ensure_ascii=False)}
    if role != "assistant" or not m.get("tool_calls"):
        return m
    raw = m["tool_calls"]
    if not isinstance(raw, list):
        raise field_error(f"messages[{i}].tool_calls", "must be a list of calls")
    calls = [_call(c, f"messages[{i}].tool_calls[{j}]", fmt) for j, c in enumerate(raw)]
    if fmt.native:
        return {**m, "tool_calls": calls}
    text = generic_envelope(calls)
    content = _text(m.get("content"))
    return {k: v for k, v in m.items() if k != "tool_calls"} | {"content": (content + "\n" if content else "") + text}


def _call(c: Any, where: str, fmt: ToolFormat) -> dict[str, Any]:
    if not isinstance(c, dict) or c.get("type", "function") != "function" or not isinstance(c.get("function"), dict):
        raise field_error(where, 'must be {"id", "type": "function", "function": {"name", "arguments"}}')
    fn = c["function"]
    if not isinstance(fn.get("name"), str):
        raise field_error(f"{where}.function.name", "must be a string")
    arguments = fn.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise field_error(f"{where}.function.arguments", "must be a string of JSON")
    try:
        parsed: Any = json.loads(arguments)
    except ValueError:
        parsed = arguments                 # a cut call's text: kept as the client sent it
    call_id = c.get("id")
    if fmt.id_length is not None and isinstance(call_id, str):
        call_id = template_call_id(call_id, fmt.id_length)
    return {"id": call_id, "type": "function", "function": {"name": fn["name"], "arguments": parsed}}


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def generic_envelope(calls: list[dict[str, Any]]) -> str:
    """Calls as the generic envelope (the text such a model was told to write)."""
    return json.dumps({"tool_calls": [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                                      for c in calls]}, ensure_ascii=False)
