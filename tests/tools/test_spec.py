"""A request's tool fields read into a ToolSpec, or an error naming the field as the request
spelled it; limits; legacy functions refused by name; the constraint's shape per choice."""
import pytest

import pagedecode as pd
from pagedecode.errors import InvalidFieldError
from pagedecode.tools import (FORMATS, GENERIC, HERMES, MISTRAL, ToolLimits, parse_tool_fields, tool_constraint)

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def fn(name="get_weather", **kw):
    return {"type": "function", "function": {"name": name, "parameters": SCHEMA, **kw}}


def refused(body, field, flat=False, limits=ToolLimits()):
    with pytest.raises(InvalidFieldError) as e:
        parse_tool_fields(body, limits, flat)
    assert e.value.field == field, str(e.value)
    return str(e.value)


def test_a_full_request_reads_into_a_spec():
    spec = parse_tool_fields({"tools": [fn(description="Weather", strict=True), fn("b")],
                              "tool_choice": {"type": "function", "function": {"name": "b"}},
                              "parallel_tool_calls": False})
    assert [t.name for t in spec.tools] == ["get_weather", "b"] and spec.tools[0].description == "Weather"
    assert spec.tools[0].strict is True and spec.mode == "named" and spec.named == "b" and not spec.parallel
    assert [t.name for t in spec.callable] == ["b"]


def test_defaults_and_no_tools():
    spec = parse_tool_fields({"tools": [{"type": "function", "function": {"name": "f"}}]})
    assert spec.mode == "auto" and spec.parallel and spec.tools[0].parameters == {"type": "object"}
    assert parse_tool_fields({}) is None and parse_tool_fields({"tools": [], "tool_choice": "none"}) is None
    assert parse_tool_fields({"tools": [fn()], "tool_choice": "none"}).calls_possible is False


def test_the_responses_api_flat_shape():
    spec = parse_tool_fields({"tools": [{"type": "function", "name": "f", "parameters": SCHEMA}],
                              "tool_choice": {"type": "function", "name": "f"}}, flat=True)
    assert spec.named == "f"
    refused({"tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]},
            "tools[0].parameters", flat=True)


@pytest.mark.parametrize("body, field", [
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": ["x"]}, "tools[0]"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [fn("bad name")]}, "tools[0].function.name"),
    ({"tools": [fn("x" * 65)]}, "tools[0].function.name"),
    ({"tools": [fn(), fn()]}, "tools[1].function.name"),
    ({"tools": [fn(description=3)]}, "tools[0].function.description"),
    ({"tools": [fn(strict="yes")]}, "tools[0].function.strict"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tools": [fn(), {"type": "function", "function": {"name": "g", "parameters": {"type": "array"}}}]},
     "tools[1].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "contentEncoding": "base64"}}}}}]},
     "tools[0].function.parameters"),
    ({"tools": [fn()], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [fn()], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"tools": [fn()], "tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [fn()], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
])
def test_errors_name_the_field(body, field):
    refused(body, field)


def test_limits_name_the_field():
    assert "at most 2 tools" in refused({"tools": [fn("a"), fn("b"), fn("c")]}, "tools", limits=ToolLimits(max_tools=2))
    deep: dict = {"type": "object"}
    for _ in range(10):
        deep = {"type": "object", "properties": {"a": deep}}
    body = {"tools": [{"type": "function", "function": {"name": "f", "parameters": deep}}]}
    assert "nests" in refused(body, "tools[0].function.parameters", limits=ToolLimits(max_schema_depth=8))
    assert "bytes" in refused({"tools": [fn("a"), fn("b")]}, "tools", limits=ToolLimits(max_schema_bytes=150))


def test_the_constraint_per_choice():
    tools = [fn("a"), fn("b")]
    assert tool_constraint(parse_tool_fields({"tools": tools, "tool_choice": "none"}), HERMES) is None
    named = tool_constraint(parse_tool_fields({"tools": tools, "tool_choice": {"type": "function",
                                                                             "function": {"name": "b"}}}), HERMES)
    fmt = named.structural_tag["format"]
    assert fmt["type"] == "tags_with_separator" and fmt["stop_after_first"] and fmt["at_least_one"]
    assert [t["begin"] for t in fmt["tags"]] == ['<tool_call>\n{"name": "b", "arguments": ']
    required = tool_constraint(parse_tool_fields({"tools": tools, "tool_choice": "required"}), MISTRAL)
    fmt = required.structural_tag["format"]
    assert fmt["begin"] == "[TOOL_CALLS][" and not fmt["content"]["stop_after_first"]
    auto = tool_constraint(parse_tool_fields({"tools": tools, "parallel_tool_calls": False}), HERMES)
    fmt = auto.structural_tag["format"]
    assert fmt["type"] == "triggered_tags" and fmt["triggers"] == ["<tool_call>"] and fmt["stop_after_first"]
    generic = tool_constraint(parse_tool_fields({"tools": tools}), GENERIC).structural_tag["format"]
    assert generic["type"] == "or" and generic["elements"][0]["begin"] == '{"response": '
    assert all(isinstance(tool_constraint(parse_tool_fields({"tools": tools}), f), pd.StructuredOutput)
               for f in FORMATS.values())


def test_structural_tag_constraints_are_checked_like_schemas():
    with pytest.raises(pd.InvalidRequestError, match="structural_tag must be"):
        pd.StructuredOutput(structural_tag={"format": {}})
    bad = {"type": "structural_tag", "format": {"type": "tag", "begin": "<a>", "end": "</a>", "content": {
        "type": "json_schema", "json_schema": {"type": "string", "contentEncoding": "base64"}}}}
    with pytest.raises(pd.InvalidRequestError, match="contentEncoding"):
        pd.StructuredOutput(structural_tag=bad)
    nested: dict = {"type": "object"}
    for _ in range(5):
        nested = {"type": "object", "properties": {"a": nested}}
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<a>", "end": "</a>", "content": {
        "type": "json_schema", "json_schema": nested}}}
    so = pd.StructuredOutput(structural_tag=tag)
    assert so.kind == "structural_tag" and so.depth == pd.StructuredOutput(json_schema=nested).depth
    assert so.key.startswith("structural_tag:") and so.size > 0


def test_check_grammars_names_the_tool_xgrammar_refuses():
    pytest.importorskip("xgrammar")
    from pagedecode.tools import check_grammars
    spec = parse_tool_fields({"tools": [fn("a"), {"type": "function", "function": {"name": "b", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(unclosed"}}}}}]})
    with pytest.raises(InvalidFieldError) as e:
        check_grammars(spec)
    assert e.value.field == "tools[1].function.parameters"
