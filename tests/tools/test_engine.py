"""Tool calls generated through the Engine on the built-in random model (the worst case: it
follows nothing but the grammar): under named and required, over 200 random schemas in every
format, every call parses and validates; the finish reason agrees with what was parsed;
speculative decoding gives the same calls."""
import json
import random
import zlib

import pytest

import pagedecode as pd
from pagedecode.tools import (FORMATS, parse_tool_fields, parse_tool_output, tool_constraint,
                              tool_finish_reason)

from .schemas import tool

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
FMTS = list(FORMATS.values())
MAX_TOKENS = 200          # far above the longest call the bounded schemas allow (~120 tokens)


@pytest.fixture(scope="module")
def engine_factory():
    from pagedecode.model.default_model import default_model_path
    path = default_model_path()
    return lambda **kw: pd.Engine.from_pretrained(path, max_batch_size=256, **kw)


@pytest.fixture(scope="module")
def tools():
    rng = random.Random(zlib.crc32(b"pagedecode tools"))
    return [tool(rng, i) for i in range(200)]


def named(t):
    return {"tools": [t], "tool_choice": {"type": "function", "function": {"name": t["function"]["name"]}}}


def requests(tools):
    """(format, tools, request fields): each schema named alone, and in fours under required."""
    out = [(FMTS[i % 4], [t], named(t)) for i, t in enumerate(tools)]
    out += [(FMTS[j % 4], tools[4 * j:4 * j + 4], {"tools": tools[4 * j:4 * j + 4], "tool_choice": "required",
                                                    "parallel_tool_calls": False}) for j in range(len(tools) // 4)]
    return out


def generate(engine, reqs, max_tokens=MAX_TOKENS):
    params = [pd.SamplingParams(max_tokens=max_tokens, temperature=0,
                                structured_output=tool_constraint(parse_tool_fields(body), fmt))
              for fmt, _, body in reqs]
    return engine.generate([f"request {i}: call a tool" for i in range(len(reqs))], params)


def test_every_call_parses_and_validates_under_named_and_required(engine_factory, tools):
    reqs = requests(tools)
    outs = generate(engine_factory(), reqs)
    for (fmt, given, body), out in zip(reqs, outs):
        parsed = parse_tool_output(out.text, fmt)
        assert out.finish_reason == pd.FinishReason.GRAMMAR_COMPLETE, (fmt.name, out.text)
        assert len(parsed.calls) == 1 and parsed.complete, (fmt.name, out.text)
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in given}
        call = parsed.calls[0]
        if body["tool_choice"] != "required":
            assert call.name == given[0]["function"]["name"]
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        assert parsed.content == ""
        assert tool_finish_reason(parsed, out.finish_reason.value) == "tool_calls"


def test_a_cut_call_finishes_with_length(engine_factory, tools):
    reqs = requests(tools[:8])[:8]
    outs = generate(engine_factory(), reqs, max_tokens=12)
    for (fmt, _, _), out in zip(reqs, outs):
        parsed = parse_tool_output(out.text, fmt)
        assert out.finish_reason == pd.FinishReason.MAX_OUTPUT_TOKENS
        assert tool_finish_reason(parsed, out.finish_reason.value) == "length"
        assert not (parsed.calls and parsed.complete)


def test_auto_calls_parse_and_validate_once_started(engine_factory, tools):
    """Under auto the random model mostly writes text; whatever calls it starts are held to
    their schemas (the parallel-free section ends the grammar)."""
    reqs = [(fmt, tools[i:i + 2], {"tools": tools[i:i + 2], "parallel_tool_calls": False})
            for i, fmt in zip(range(0, 16, 2), FMTS * 2)]
    outs = generate(engine_factory(), reqs, max_tokens=40)
    for (fmt, given, _), out in zip(reqs, outs):
        parsed = parse_tool_output(out.text, fmt)
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in given}
        for call in parsed.calls:
            if call.complete:
                jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        expected = "length" if out.finish_reason == pd.FinishReason.MAX_OUTPUT_TOKENS else \
            "tool_calls" if parsed.calls else "stop"
        assert tool_finish_reason(parsed, out.finish_reason.value) == expected


def test_speculation_on_and_off_give_the_same_calls(engine_factory, tools):
    """Required calls, parallel: repeated calls give the n-gram proposer text to draft from
    (at most 8 requests: speculation proposes nothing for larger batches)."""
    reqs = [(fmt, tools[i:i + 3], {"tools": tools[i:i + 3], "tool_choice": "required"})
            for i, fmt in zip(range(0, 24, 3), FMTS * 2)]
    plain = generate(engine_factory(), reqs, max_tokens=120)
    engine = engine_factory(speculative=pd.SpeculativeConfig(method="ngram", num_tokens=4, min_ngram=2))
    spec = generate(engine, reqs, max_tokens=120)
    assert engine.snapshot().spec_decode_num_accepted_tokens > 0
    for (fmt, _, _), a, b in zip(reqs, plain, spec):
        calls_a, calls_b = parse_tool_output(a.text, fmt).calls, parse_tool_output(b.text, fmt).calls
        assert calls_a and [(c.name, c.arguments) for c in calls_a] == [(c.name, c.arguments) for c in calls_b]
        assert a.selected_token_ids == b.selected_token_ids
