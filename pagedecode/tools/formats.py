"""How a model writes tool calls: the text around each call's JSON object, named by format.

Every format writes a call as `CALL_BEGIN{"name": "NAME", "ARGS_KEY": ARGUMENTS}CALL_END`,
calls joined by SEPARATOR, the whole between SECTION_BEGIN and SECTION_END:

    hermes    <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   (Hermes, Qwen 2.5)
    llama3    {"name": "f", "parameters": {...}}; {...}                     (Llama 3.1-3.3 JSON)
    mistral   [TOOL_CALLS][{"name": "f", "arguments": {...}}, {...}]        (Mistral v3 style)
    generic   {"tool_calls": [{"name": "f", "arguments": {...}}]}           (any template; as
              or {"response": "text"}                                       llama.cpp's generic)

Mistral's templates also take only call ids of 9 letters and digits (id_length): the calls a
server returns are named so, and the history's ids are mapped to such ids (prompt.py).

The generic format is for templates that know nothing of tools: the tools are described in the
system message (prompt.py) and the whole output is one JSON envelope, a reply or calls. The
constraint (constraint.py) writes exactly these strings; the parser (stream.py) also takes
whitespace between the JSON tokens, as models write them unconstrained.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import InvalidFieldError


@dataclass(frozen=True)
class ToolFormat:
    name: str
    trigger: str               # the text that starts calls under tool_choice auto
    call_begin: str = ""       # before a call's object
    call_end: str = ""         # after it
    separator: str = ""        # between calls
    section_begin: str = ""    # before the first call
    section_end: str = ""      # after the last
    args_key: str = "arguments"
    native: bool = True        # the chat template renders the tools itself
    envelope: bool = False     # the whole output is one JSON object (generic): calls only at its start
    id_length: int | None = None   # the template takes call ids of exactly this many letters and digits
                                   # (Mistral's raise on any other); None: any id

    def call_prefix(self, name: str) -> str:
        """A call's text up to its arguments object."""
        return f'{self.call_begin}{{"name": {json.dumps(name)}, "{self.args_key}": '

    def call_suffix(self) -> str:
        return "}" + self.call_end

    def write(self, calls: list[tuple[str, str]]) -> str:
        """The text of (name, arguments JSON) calls in this format (tests; history rendering)."""
        body = self.separator.join(self.call_prefix(n) + a + self.call_suffix() for n, a in calls)
        return self.section_begin + body + self.section_end


HERMES = ToolFormat("hermes", trigger="<tool_call>", call_begin="<tool_call>\n", call_end="\n</tool_call>",
                    separator="\n")
LLAMA3 = ToolFormat("llama3", trigger='{"name": ', separator="; ", args_key="parameters")
MISTRAL = ToolFormat("mistral", trigger="[TOOL_CALLS]", separator=", ", section_begin="[TOOL_CALLS][",
                     section_end="]", id_length=9)
GENERIC = ToolFormat("generic", trigger='{"tool_calls": ', separator=", ", section_begin='{"tool_calls": [',
                     section_end="]}", native=False, envelope=True)
FORMATS = {f.name: f for f in (HERMES, LLAMA3, MISTRAL, GENERIC)}

PROBE_NAME = "pagedecode_probe_tool"
PROBE_TOOL = {"type": "function", "function": {"name": PROBE_NAME, "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}
Render = Callable[[list[dict[str, Any]], dict[str, Any]], str]   # (messages, extra template variables) -> text


def renders_tools(render: Render) -> bool:
    """The template shows a tool it is given (a template that names `tools` may still drop them)."""
    try:
        text = render([{"role": "user", "content": "hi"}], {"tools": [PROBE_TOOL]})
    except Exception:
        return False
    return PROBE_NAME in text


def detect_format(template: str | None, render: Render | None = None, name: str | None = None) -> ToolFormat:
    """The format for a chat template's source: `name` when given (an option: --tool-format),
    else by the markers the template writes; generic for a template without tool support (one
    that never reads `tools`, or, given `render`, does not show a probe tool)."""
    if name is not None:
        if name not in FORMATS:
            raise InvalidFieldError("tools", "format", f"must be one of {sorted(FORMATS)}, got {name!r}")
        return FORMATS[name]
    if not template or not re.search(r"\btools\b", template):
        return GENERIC
    if render is not None and not renders_tools(render):
        return GENERIC
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|python_tag|>" in template or ('"parameters"' in template and "<|start_header_id|>" in template):
        return LLAMA3
    return GENERIC
