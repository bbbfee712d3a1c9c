"""Tool calls finish within their request's budget (runtime/grammar_close.py), on the built-in
random model: it follows nothing but the grammar and seldom ends a string, so without the
forced close most calls below are cut by max_tokens. With max_tokens a little above each call's
shortest form, named and required calls in every format parse, validate and end as calls; the
context's room is a budget too; speculation on and off give the same tokens."""
import json
import random
import zlib

import pytest

import pagedecode as pd
from pagedecode.runtime.grammar_close import Closer
from pagedecode.tools import FORMATS, parse_tool_fields, parse_tool_output, tool_constraint, tool_finish_reason

from .schemas import tool

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
FMTS = list(FORMATS.values())


@pytest.fixture(scope="module")
def path():
    from pagedecode.model.default_model import default_model_path
    return default_model_path()


@pytest.fixture(scope="module")
def engine(path):
    return pd.Engine.from_pretrained(path, max_batch_size=64)


def cases(n, seed=b"pagedecode close"):
    """(format, request fields): named calls, and required ones (parallel) over three tools."""
    rng = random.Random(zlib.crc32(seed))
    tools = [tool(rng, i) for i in range(n + 2)]
    out = []
    for i in range(n):
        t = tools[i]
        body = ({"tools": [t], "tool_choice": {"type": "function", "function": {"name": t["function"]["name"]}}}
                if i % 2 else {"tools": tools[i:i + 3], "tool_choice": "required"})
        out.append((FMTS[i % 4], body))
    return out


def shortest(engine, so):
    """The tokens of the constraint's shortest call (the way to finish it from its start)."""
    c = engine.constraints.compiler
    c.warm().result()
    m = c.matcher(c.submit(so).compiled.result())
    return len(Closer(c.token_bytes, c.stop_ids, engine.vocab_size).way(m, 10_000))


def params(engine, reqs, slack):
    out = []
    for i, (fmt, body) in enumerate(reqs):
        so = tool_constraint(parse_tool_fields(body), fmt)
        out.append(pd.SamplingParams(max_tokens=shortest(engine, so) + slack(i), temperature=1.0, seed=i,
                                     structured_output=so))
    return out


def check_calls(reqs, outs):
    for (fmt, body), out in zip(reqs, outs):
        parsed = parse_tool_output(out.text, fmt)
        assert tool_finish_reason(parsed, out.finish_reason.value) == "tool_calls", (fmt.name, out.text)
        assert parsed.complete and parsed.content == ""
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in body["tools"]}
        for call in parsed.calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def closed(engine, outs):
    """How many of the outputs had a token replaced to finish their call in time."""
    return sum(any(r["kind"] == "grammar.closing" for r in engine.trace(o.request_id)) for o in outs)


def test_named_and_required_calls_always_close_within_max_tokens(engine):
    reqs = cases(32)
    ps = params(engine, reqs, lambda i: i % 16)
    outs = engine.generate([f"request {i}: call a tool" for i in range(len(reqs))], ps)
    check_calls(reqs, outs)
    assert all(len(o.selected_token_ids) <= p.max_tokens for o, p in zip(outs, ps))
    assert closed(engine, outs) >= len(reqs) // 2      # without it, 70 of 120 such calls were cut


def test_the_contexts_room_is_a_budget_too(path):
    engine = pd.Engine.from_pretrained(path, max_batch_size=16, max_context=80)
    reqs = [r for r in cases(16, b"context") if shortest(engine, tool_constraint(parse_tool_fields(r[1]), r[0])) < 64]
    ps = [pd.SamplingParams(max_tokens=1000, temperature=1.0, seed=i,
                            structured_output=tool_constraint(parse_tool_fields(body), fmt))
          for i, (fmt, body) in enumerate(reqs)]
    outs = engine.generate([f"request {i}" for i in range(len(reqs))], ps)
    check_calls(reqs, outs)
    assert all(len(o.prompt_token_ids) + len(o.selected_token_ids) <= 80 for o in outs)
    assert closed(engine, outs) >= len(reqs) // 4


NOTE = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"], "additionalProperties": False}}}


def test_speculation_on_and_off_give_the_same_closed_calls(path):
    """A call whose free string the random model never ends, the call's own text in the prompt
    for the n-gram proposer to draft from; at most 8 requests (speculation proposes nothing for
    larger batches)."""
    reqs = [(fmt, {"tools": [NOTE], "tool_choice": "required" if i % 2 else {
        "type": "function", "function": {"name": "note"}}}) for i, fmt in enumerate(FMTS)]
    prompts = [f"{i}: " + fmt.write([("note", '{"text": "a note"}')]) * 2 for i, (fmt, _) in enumerate(reqs)]
    runs = []
    for spec in (None, pd.SpeculativeConfig(method="ngram", num_tokens=4, min_ngram=2)):
        engine = pd.Engine.from_pretrained(path, max_batch_size=8, speculative=spec)
        ps = params(engine, reqs, lambda i: 12 + i)
        outs = engine.generate(prompts, ps)
        check_calls(reqs, outs)
        assert closed(engine, outs) == len(reqs)
        runs.append(outs)
    assert engine.snapshot().spec_decode_num_accepted_tokens > 0
    for a, b in zip(*runs):
        assert a.selected_token_ids == b.selected_token_ids and a.finish_reason == b.finish_reason


def test_auto_calls_close_once_started(engine):
    """Under auto a call is closed in time once its trigger (several tokens) is written; a reply
    is left to be cut. Generic format (a reply or calls, as one JSON object), the random model
    nudged towards calls by a logit_bias on tokens starting with "t" (so a replaced token also
    rebuilds the slot's penalty record)."""
    from pagedecode.runtime.grammar_compiler import token_bytes_table
    table = token_bytes_table(engine.tokenizer, engine.vocab_size)
    bias = {i: 8.0 for i, b in enumerate(table) if b.startswith(b"t")}
    reqs = [(FORMATS["generic"], {"tools": [NOTE], "parallel_tool_calls": False})] * 12
    ps = [pd.SamplingParams(max_tokens=120, temperature=1.0, seed=i, logit_bias=bias,
                            structured_output=tool_constraint(parse_tool_fields(body), fmt))
          for i, (fmt, body) in enumerate(reqs)]
    outs = engine.generate([f"auto {i}" for i in range(len(reqs))], ps)
    calls = [(r, o) for r, o in zip(reqs, outs) if o.text.startswith('{"tool_calls"')]
    assert 0 < len(calls) < len(outs)
    check_calls(*zip(*calls))
    assert closed(engine, [o for _, o in calls]) == len(calls)
    replies = [o for o in outs if o.text.startswith('{"response"')]
    assert closed(engine, replies) == 0 and all(o.finish_reason == pd.FinishReason.MAX_OUTPUT_TOKENS for o in replies)
