"""The tool-call parser: whole outputs parsed in every format, and the stream parser's deltas,
folded, equal the whole parse over any chunking (hypothesis), 2-3 calls in one delta included."""
import itertools
import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pagedecode.tools import (FORMATS, GENERIC, HERMES, ContentDelta, ToolCallDelta, ToolCallEnd, ToolOutput,
                              ToolStreamParser, new_call_id, parse_tool_output)

NASTY = ['{"q": "</tool_call>"}', '{"s": "a\\"b}{]["}', '{"x": [1, {"y": {}}], "z": null}',
         '{"t": "[TOOL_CALLS]\\\\"}', '{}', '{"u": "\\u00e9\\ud83d\\ude00"}']


def counter():
    n = itertools.count()
    return lambda: f"call_{next(n)}"


def fold(deltas):
    out = ToolOutput()
    for d in deltas:
        out.apply(d)
    return out


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=lambda f: f.name)
def test_calls_in_every_format_parse_back_exactly(fmt):
    calls = [("get_weather", NASTY[0]), ("f-2", NASTY[1]), ("x", NASTY[2])]
    out = parse_tool_output(fmt.write(calls), fmt, counter())
    assert [(c.name, c.arguments, c.complete) for c in out.calls] == [(n, a, True) for n, a in calls]
    assert [c.id for c in out.calls] == ["call_0", "call_1", "call_2"]
    assert out.content == ""
    assert all(isinstance(json.loads(c.arguments), dict) for c in out.calls)


@pytest.mark.parametrize("fmt", [f for f in FORMATS.values() if not f.envelope], ids=lambda f: f.name)
def test_content_around_calls_stays_content(fmt):
    text = "Let me check. " + fmt.write([("a", "{}")]) + " Done."
    out = parse_tool_output(text, fmt)
    assert [c.name for c in out.calls] == ["a"]
    assert out.content.strip().split() == ["Let", "me", "check.", "Done."]


def test_a_close_string_inside_arguments_never_ends_the_call():
    """vLLM #45167: a string argument holding </tool_call> dropped the call."""
    text = '<tool_call>\n{"name": "note", "arguments": {"text": "a</tool_call>b}"}}\n</tool_call>'
    out = parse_tool_output(text, HERMES)
    assert [json.loads(c.arguments) for c in out.calls] == [{"text": "a</tool_call>b}"}]


def test_text_that_only_looks_like_a_call_is_content():
    for text in ["<tool_call> is a tag", "<tool_call>\n{\"nam", "a < b", "[TOOL_CALLS", "{\"name\": 3}"]:
        for fmt in FORMATS.values():
            out = parse_tool_output(text, fmt)
            assert out.calls == [] and out.content == text, (fmt.name, text, out)


def test_a_cut_call_is_incomplete_and_keeps_its_arguments_so_far():
    text = HERMES.write([("a", '{"x": 1}')]) + '\n<tool_call>\n{"name": "b", "arguments": {"y": "long'
    out = parse_tool_output(text, HERMES)
    assert [(c.name, c.complete) for c in out.calls] == [("a", True), ("b", False)]
    assert out.calls[1].arguments == '{"y": "long'
    assert not out.complete


def test_unfinished_closing_text_after_a_call_is_dropped():
    out = parse_tool_output('<tool_call>\n{"name": "a", "arguments": {}}\n</tool', HERMES)
    assert out.content == "" and out.calls[0].complete


def test_generic_reply_is_content_with_json_escapes_decoded():
    text = json.dumps({"response": 'say "hi"\n\\ é 😀 {"tool_calls": []}'}, ensure_ascii=True)
    out = parse_tool_output(text, GENERIC)
    assert out.content == 'say "hi"\n\\ é 😀 {"tool_calls": []}' and out.calls == []
    assert parse_tool_output('{"response": "a\\ud800b"}', GENERIC).content == "a\ufffdb"   # a lone surrogate


def test_generic_calls_only_at_the_start():
    text = "hi " + GENERIC.write([("a", "{}")])
    assert parse_tool_output(text, GENERIC).calls == []


def test_deltas_name_first_then_arguments_then_end():
    parser = ToolStreamParser(HERMES, counter())
    deltas = parser.feed(HERMES.write([("a", '{"k": 1}')]))
    assert deltas == [ToolCallDelta(0, "", id="call_0", name="a"), ToolCallDelta(0, '{"k": 1}'), ToolCallEnd(0)]
    assert parser.finish() == []


def test_ids_are_call_and_random_and_unique():
    ids = {new_call_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(i.startswith("call_") and len(i) == 29 and i[5:].isalnum() for i in ids)


# -- the property: any chunking gives the same parse ------------------------------------------
def outputs(fmt):
    """Texts a model writes: content, calls (nasty arguments), cut anywhere or not."""
    call = st.tuples(st.sampled_from(["a", "get_weather", "x-1"]), st.sampled_from(NASTY))
    content = st.sampled_from(["", "Sure! ", "a < b {x} ", "<tool", "[TOOL_CALLS", "\n"])
    whole = st.builds(lambda pre, calls, post: pre + fmt.write(calls) + post, content,
                      st.lists(call, min_size=1, max_size=3), content)
    if fmt.envelope:
        reply = st.text(max_size=30).map(lambda t: json.dumps({"response": t}))
        whole = st.one_of(st.lists(call, min_size=1, max_size=3).map(fmt.write), reply)
    return st.tuples(whole, st.floats(0.2, 1.0)).map(lambda tc: tc[0][:max(1, int(len(tc[0]) * tc[1]))]
                                                     if tc[1] < 0.999 else tc[0])


def chunked(text, cuts):
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=lambda f: f.name)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_streamed_deltas_fold_to_the_whole_parse(fmt, data):
    text = data.draw(outputs(fmt))
    cuts = data.draw(st.lists(st.integers(0, 10_000), max_size=12))
    want = parse_tool_output(text, fmt, counter())
    parser = ToolStreamParser(fmt, counter())
    deltas = [d for chunk in chunked(text, cuts) for d in parser.feed(chunk)] + parser.finish()
    assert fold(deltas) == want
    firsts = [d for d in deltas if isinstance(d, ToolCallDelta) and d.id is not None]
    assert [d.index for d in firsts] == list(range(len(want.calls)))     # each call announced once, in order
    assert all(isinstance(d, (ContentDelta, ToolCallDelta, ToolCallEnd)) for d in deltas)


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=lambda f: f.name)
def test_three_calls_in_one_delta(fmt):
    text = fmt.write([("a", NASTY[0]), ("b", NASTY[1]), ("c", NASTY[3])])
    parser = ToolStreamParser(fmt, counter())
    head = len(fmt.section_begin) + 3
    deltas = parser.feed(text[:head]) + parser.feed(text[head:]) + parser.finish()
    assert fold(deltas) == parse_tool_output(text, fmt, counter())
    assert [c.name for c in fold(deltas).calls] == ["a", "b", "c"]


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=lambda f: f.name)
def test_long_runs_of_near_misses_are_read_without_recursion(fmt):
    """Held text read again is queued, not recursed into: thousands of near-misses in a row
    (each `<` may begin `<tool_call>`; a name may run on) parse as content."""
    for text in ["<" * 5000, " " * 2000 + "x", "x" + " " * 5000 + "{", '<tool_call>\n{"name": "' + "a" * 400,
                 "[TOOL_CALLS" * 500]:
        out = parse_tool_output(text, fmt)
        assert out.calls == [] and out.content == text


def test_whitespace_before_a_call_stays_content():
    out = parse_tool_output("Sure!\n" + HERMES.write([("a", "{}")]), HERMES)
    assert out.content == "Sure!\n" and [c.name for c in out.calls] == ["a"]
