"""A request's tools, as plain data: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`
read and checked into a ToolSpec, or an InvalidFieldError naming the field as the request
spelled it (`tools[2].function.parameters`, `tool_choice`).

Two shapes are read: chat completions' (`{"type": "function", "function": {name, description,
parameters, strict}}`, a named choice `{"type": "function", "function": {"name": ...}}`) and
the Responses API's flat one (`{"type": "function", name, ...}`, `{"type": "function", "name":
...}`). The legacy `functions` / `function_call` fields are refused by name: their reply shape
(`message.function_call`, one call) is not the one this server writes, and accepting them as
`tools` would answer a different shape than the client asked for.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal, Mapping

from ..errors import InvalidFieldError, InvalidRequestError
from ..structured import check_schema, nesting_depth

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")       # OpenAI's rule for function names
Mode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolLimits:
    """What one request's tools may weigh (their grammar is compiled per request)."""
    max_tools: int = 128                   # OpenAI's own cap
    max_description_chars: int = 8192
    max_schema_depth: int = 64             # each tool's parameters (EngineConfig.max_schema_depth)
    max_schema_bytes: int = 32 << 10       # all tools' parameters together (EngineConfig.max_schema_bytes)


@dataclass(frozen=True)
class FunctionTool:
    name: str
    parameters: dict[str, Any]             # a JSON schema of an object (absent: any object)
    description: str | None = None
    strict: bool | None = None             # accepted; calls are always held to the schema


@dataclass(frozen=True)
class ToolSpec:
    tools: tuple[FunctionTool, ...]
    mode: Mode = "auto"
    named: str | None = None               # mode "named": the function every call is to
    parallel: bool = True                  # False: at most one call

    @property
    def calls_possible(self) -> bool:
        return bool(self.tools) and self.mode != "none"

    @property
    def callable(self) -> tuple[FunctionTool, ...]:
        """The tools a call may name (named: that one)."""
        return tuple(t for t in self.tools if self.mode != "named" or t.name == self.named)


def field_error(field: str, reason: str) -> InvalidFieldError:
    return InvalidFieldError("request", field, reason)


def parse_tool_fields(body: Mapping[str, Any], limits: ToolLimits = ToolLimits(), flat: bool = False
                      ) -> ToolSpec | None:
    """The request's tools, or None when it has none (`tools` absent, null or []). flat: the
    Responses API's shapes. A `tool_choice` other than "none" / "auto" needs tools."""
    for legacy, instead in (("functions", "tools"), ("function_call", "tool_choice")):
        if body.get(legacy) is not None:
            raise field_error(legacy, f"the deprecated {legacy} is not supported: send {instead}")
    raw = body.get("tools")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise field_error("parallel_tool_calls", f"must be true or false, got {parallel!r}")
    if raw is None or raw == []:
        choice = body.get("tool_choice")
        if choice not in (None, "none", "auto"):
            raise field_error("tool_choice", "needs tools: this request has none")
        return None
    if not isinstance(raw, list):
        raise field_error("tools", "must be a list of function tools")
    if len(raw) > limits.max_tools:
        raise field_error("tools", f"at most {limits.max_tools} tools, got {len(raw)}")
    tools = tuple(_tool(t, i, limits, flat) for i, t in enumerate(raw))
    seen: set[str] = set()
    for i, t in enumerate(tools):
        if t.name in seen:
            raise field_error(_where(i, flat, "name"), f"the name {t.name!r} is given twice")
        seen.add(t.name)
    size = sum(len(json.dumps(t.parameters)) for t in tools)
    if size > limits.max_schema_bytes:
        raise field_error("tools", f"the tools' parameters are {size} bytes of JSON schema together, over this "
                                   f"server's {limits.max_schema_bytes}")
    mode, named = _choice(body.get("tool_choice"), seen, flat)
    return ToolSpec(tools, mode, named, parallel is not False)


def _where(i: int, flat: bool, key: str) -> str:
    return f"tools[{i}].{key}" if flat else f"tools[{i}].function.{key}"


def _tool(raw: Any, i: int, limits: ToolLimits, flat: bool) -> FunctionTool:
    if not isinstance(raw, dict):
        raise field_error(f"tools[{i}]", 'must be a function tool {"type": "function", ...}')
    if raw.get("type") != "function":
        raise field_error(f"tools[{i}].type", f'must be "function" (the only kind supported), got {raw.get("type")!r}')
    fn = raw if flat else raw.get("function")
    if not isinstance(fn, dict):
        raise field_error(f"tools[{i}].function", "must be an object {name, description, parameters}")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise field_error(_where(i, flat, "name"), f"must be 1-64 letters, digits, _ or -, got {name!r}")
    description = fn.get("description")
    if description is not None and (not isinstance(description, str)
                                    or len(description) > limits.max_description_chars):
        raise field_error(_where(i, flat, "description"),
                          f"must be a string of at most {limits.max_description_chars} characters")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise field_error(_where(i, flat, "strict"), f"must be true or false, got {strict!r}")
    return FunctionTool(name, _parameters(fn.get("parameters"), _where(i, flat, "parameters"), limits),
                        description, strict)


def _parameters(schema: Any, where: str, limits: ToolLimits) -> dict[str, Any]:
    """An object schema the grammar can enforce (absent: any object)."""
    if schema is None:
        return {"type": "object"}
    if not isinstance(schema, dict):
        raise field_error(where, "must be a JSON schema object")
    if schema.get("type", "object") != "object":
        raise field_error(where, f'must describe an object (type "object"), got type {schema.get("type")!r}')
    depth = nesting_depth(schema)
    if depth > limits.max_schema_depth:
        raise field_error(where, f"nests {depth} deep, over this server's {limits.max_schema_depth}")
    try:
        check_schema(schema)
    except InvalidRequestError as e:
        raise field_error(where, str(e).split(": ", 1)[-1]) from None
    return schema


def _choice(raw: Any, names: set[str], flat: bool) -> tuple[Mode, str | None]:
    if raw is None or raw == "auto":
        return "auto", None
    if raw in ("none", "required"):
        return raw, None
    if isinstance(raw, str):
        raise field_error("tool_choice", f'must be "none", "auto", "required" or a named function, got {raw!r}')
    if not isinstance(raw, dict) or raw.get("type") != "function":
        raise field_error("tool_choice", 'a named choice is {"type": "function", "function": {"name": ...}}')
    fn = raw if flat else raw.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise field_error("tool_choice", "a named choice needs the function's name")
    if name not in names:
        raise field_error("tool_choice", f"names {name!r}, which is not one of the request's tools")
    return "named", name
