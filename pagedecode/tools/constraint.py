"""A request's tools as a constraint (an xgrammar structural tag, pd.StructuredOutput's
`structural_tag` kind), so that every call parses and matches its tool's schema:

    named      exactly one call, to that tool
    required   one call or more (parallel_tool_calls false: exactly one), nothing else
    auto       free text; once the format's trigger is written, the call is held to the
               schemas to its end (generic: the output is a reply or calls, as one JSON object)
    none       no constraint (and no calls parsed)

The text each call is forced into is the format's own (formats.py), so the parser reads it.
A call also finishes within the request's budget (max_tokens, the context): near its end, a
token that would leave the call unable to close in time is replaced by the shortest way to
close it (runtime/grammar_close.py; `close_after`: from the first token, or under auto from the
trigger), so a call is never cut: its string arguments are truncated instead.
"""
from __future__ import annotations

import json
from typing import Any

from ..structured import StructuredOutput
from .formats import ToolFormat
from .spec import FunctionTool, ToolSpec, field_error

MAX_WHITESPACE = 1      # whitespace runs inside arguments (xgrammar's least; 0 is refused): a random
                        # model left free pads JSON with newlines up to max_tokens


def _call(fmt: ToolFormat, tool: FunctionTool) -> dict[str, Any]:
    return {"type": "tag", "begin": fmt.call_prefix(tool.name),
            "content": {"type": "json_schema", "json_schema": tool.parameters, "max_whitespace_cnt": MAX_WHITESPACE},
            "end": fmt.call_suffix()}


def _calls(fmt: ToolFormat, spec: ToolSpec) -> dict[str, Any]:
    """One call or more in the format's section (one only: named, or parallel_tool_calls false)."""
    one = spec.mode == "named" or not spec.parallel
    calls = {"type": "tags_with_separator", "tags": [_call(fmt, t) for t in spec.callable],
             "separator": fmt.separator, "at_least_one": True, "stop_after_first": one}
    if not fmt.section_begin:
        return calls
    return {"type": "tag", "begin": fmt.section_begin, "content": calls, "end": fmt.section_end}


def _auto(fmt: ToolFormat, spec: ToolSpec) -> dict[str, Any]:
    if fmt.envelope:                     # generic: a reply or calls, as one JSON object
        reply = {"type": "tag", "begin": '{"response": ', "end": "}",
                 "content": {"type": "json_schema", "json_schema": {"type": "string"}}}
        return {"type": "or", "elements": [reply, _calls(fmt, spec)]}
    if fmt.section_begin:                # the section is one tag (its calls inside); then free text ends
        return {"type": "triggered_tags", "triggers": [fmt.trigger], "tags": [_calls(fmt, spec)],
                "stop_after_first": True}
    return {"type": "triggered_tags", "triggers": [fmt.trigger], "tags": [_call(fmt, t) for t in spec.callable],
            "stop_after_first": not spec.parallel}


def tool_constraint(spec: ToolSpec, fmt: ToolFormat) -> StructuredOutput | None:
    """The request's constraint (None under tool_choice none)."""
    if not spec.calls_possible:
        return None
    body = _auto(fmt, spec) if spec.mode == "auto" else _calls(fmt, spec)
    close_after = (fmt.trigger,) if spec.mode == "auto" else ()
    return StructuredOutput(structural_tag={"type": "structural_tag", "format": body}, close_after=close_after)


def check_grammars(spec: ToolSpec, flat: bool = False) -> None:
    """Parse each tool's schema with xgrammar now, so a schema it cannot take is refused
    naming the tool (`tools[i].function.parameters`), not the request's whole constraint. A
    few ms per tool; the server runs it off its event loop. Needs xgrammar."""
    from ..runtime.grammar_compiler import xgrammar
    xgr = xgrammar()
    for i, tool in enumerate(spec.tools):
        try:
            xgr.Grammar.from_json_schema(json.dumps(tool.parameters), any_whitespace=False, strict_mode=True)
        except Exception as e:
            msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            where = f"tools[{i}].parameters" if flat else f"tools[{i}].function.parameters"
            raise field_error(where, f"the grammar cannot take this schema: {msg}") from None

