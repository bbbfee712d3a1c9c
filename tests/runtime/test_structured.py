"""Structured output through xgrammar: every constrained output is valid, ends grammar_complete,
survives preemption unchanged; unconstrained neighbours are untouched; bad constraints are
refused at add_request; compiles never block the step loop."""
import json
import re
import time

import pytest
import torch

import pagedecode as pd

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
S, R = pd.RequestState, pd.FinishReason

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "happy": {"type": "boolean"}, "pet": {"enum": ["cat", "dog", "fish"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2}},
    "required": ["name", "age", "happy", "pet", "tags"], "additionalProperties": False}
CONSTRAINTS = [
    ("json_schema", pd.StructuredOutput(json_schema=SCHEMA), lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    ("regex", pd.StructuredOutput(regex=r"[a-z]{2,6} [0-9]{2}!"), lambda t: re.fullmatch(r"[a-z]{2,6} [0-9]{2}!", t)),
    ("choice", pd.StructuredOutput(choice=["yes", "no", "not sure"]), lambda t: t in ("yes", "no", "not sure")),
    ("ebnf", pd.StructuredOutput(ebnf='root ::= "(" item ("," item){0,2} ")"\nitem ::= [a-z]{1,4}'),
     lambda t: re.fullmatch(r"\([a-z]{1,4}(,[a-z]{1,4}){0,2}\)", t)),
    ("json_object", pd.StructuredOutput(json_object=True), lambda t: isinstance(json.loads(t), dict)),
]


@pytest.fixture(scope="module", params=["stories260k", "default-bpe"])
def engine_factory(request, stories_path, tmp_path_factory):
    if request.param == "stories260k":
        path = stories_path
    else:                                        # the built-in model: a byte-level BPE trained locally
        import os
        os.environ["PAGEDECODE_CACHE"] = str(tmp_path_factory.mktemp("cache"))
        from pagedecode.model.default_model import default_model_path
        path = default_model_path()
    return lambda **kw: pd.Engine.from_pretrained(path, **kw)


def check(out, valid, name):
    if name == "json_object" and out.finish_reason == R.MAX_OUTPUT_TOKENS:
        assert out.text.startswith("{")          # an unbounded string may run to max_tokens: still JSON so far
        return
    assert out.state == S.FINISHED and out.finish_reason == R.GRAMMAR_COMPLETE, (name, out.text, out.finish_reason)
    assert valid(out.text) is not False, (name, out.text)


def test_every_constraint_kind_greedy_and_seeded(engine_factory):
    eng = engine_factory()
    for name, so, valid in CONSTRAINTS:
        outs = eng.generate(["Once upon a time"] * 3,
                            [pd.SamplingParams(max_tokens=120, structured_output=so)] +
                            [pd.SamplingParams(max_tokens=120, temperature=1.0, seed=s, structured_output=so)
                             for s in (1, 2)])
        for out in outs:
            check(out, valid, name)


def test_same_output_with_forced_preemption(engine_factory):
    so = pd.StructuredOutput(json_schema=SCHEMA)
    params = [pd.SamplingParams(max_tokens=120, temperature=1.0, seed=s, structured_output=so) for s in range(4)]
    want = [o.text for o in engine_factory().generate(["Once upon a time"] * 4, params)]
    tight = engine_factory(page_size=4, max_cache_tokens=96, enable_prefix_caching=False)
    outs = tight.generate(["Once upon a time"] * 4, params)
    assert sum(any(r["kind"] == "preempted" for r in tight.trace(o.request_id)) for o in outs) > 0
    assert [o.text for o in outs] == want


def test_unconstrained_neighbours_are_untouched(engine_factory):
    eng = engine_factory()
    plain = [pd.SamplingParams(max_tokens=20), pd.SamplingParams(max_tokens=20, temperature=0.9, seed=5)]
    alone = [o.selected_token_ids for o in eng.generate(["Lily", "Tom"], plain)]
    mixed = eng.generate(["Lily", "x", "Tom", "y"],
                         [plain[0], pd.SamplingParams(max_tokens=60, structured_output=CONSTRAINTS[0][1]), plain[1],
                          pd.SamplingParams(max_tokens=60, structured_output=CONSTRAINTS[1][1])])
    assert [mixed[0].selected_token_ids, mixed[2].selected_token_ids] == alone


@pytest.mark.parametrize("kwargs, match", [
    (dict(json_schema={"type": "strin"}), "strin"),
    (dict(json_schema='{"type": '), "not valid JSON"),
    (dict(json_schema={"type": "array", "uniqueItems": True}), "uniqueItems"),
    (dict(json_schema={"not": {"type": "string"}}), "not"),
    (dict(json_schema={"type": "string", "format": "credit-card"}), "format"),
    (dict(regex="a(b"), "parenthesis"),
    (dict(ebnf="root ::= ("), "EBNF"),
    (dict(choice=[]), "choice"),
    (dict(regex="a", choice=["a"]), "exactly one"),
    (dict(), "exactly one"),
])
def test_bad_constraints_are_refused_and_the_engine_is_unaffected(stories_engine_factory, kwargs, match):
    eng = stories_engine_factory()
    with pytest.raises(pd.InvalidRequestError, match=match):
        eng.add_request("Once", pd.SamplingParams(structured_output=pd.StructuredOutput(**kwargs)))
    assert not eng.has_unfinished()
    assert eng.generate("Once", pd.SamplingParams(max_tokens=3))[0].state == S.FINISHED


def test_a_slow_compile_never_blocks_other_requests(stories_engine_factory):
    eng = stories_engine_factory()
    eng.generate("x", pd.SamplingParams(max_tokens=1, structured_output=pd.StructuredOutput(regex="[a-z]")))
    eng.constraints.compiler.compile_delay_s = 1.5
    slow = eng.add_request("Once", pd.SamplingParams(max_tokens=30, structured_output=pd.StructuredOutput(
        regex=r"[a-z]{3} [a-z]{3}")))
    fast = eng.add_request("Lily", pd.SamplingParams(max_tokens=12))
    t = time.perf_counter()
    while not eng.result(fast).state.terminal:
        eng.step()
    assert time.perf_counter() - t < 1.2 and eng.result(slow).state == S.QUEUED     # waited, did not block
    while eng.has_unfinished():
        eng.step()
        time.sleep(0.01)
    assert eng.result(slow).finish_reason == R.GRAMMAR_COMPLETE


def test_compile_timeout_cancel_and_deadline_while_compiling(stories_engine_factory):
    eng = stories_engine_factory(grammar_compile_timeout_s=0.2)
    eng.generate("x", pd.SamplingParams(max_tokens=1, structured_output=pd.StructuredOutput(regex="[a-z]")))
    eng.constraints.compiler.compile_delay_s = 1.0
    late = eng.add_request("a", pd.SamplingParams(structured_output=pd.StructuredOutput(regex="[0-9]{4}")))
    gone = eng.add_request("b", pd.SamplingParams(structured_output=pd.StructuredOutput(regex="[0-9]{5}")))
    timed = eng.add_request("c", pd.SamplingParams(deadline_s=0.05,
                                                   structured_output=pd.StructuredOutput(regex="[0-9]{6}")))
    assert eng.cancel(gone)
    end = time.time() + 10
    while eng.has_unfinished() and time.time() < end:
        eng.step()
        time.sleep(0.01)
    assert eng.result(late).state == S.FAILED and "longer than 0.2s" in eng.result(late).error
    assert eng.result(gone).state == S.CANCELLED
    assert eng.result(timed).finish_reason == R.DEADLINE_EXCEEDED
    for rid in (late, gone, timed):                      # the grammar is released once, like the rest
        assert [x["resource"] for x in eng.trace(rid) if x["kind"] == "release"].count("grammar") == 1


def test_without_xgrammar_the_error_says_how_to_install(stories_engine_factory, monkeypatch):
    import builtins
    real = builtins.__import__

    def no_xgrammar(name, *a, **kw):
        if name == "xgrammar":
            raise ImportError("no xgrammar")
        return real(name, *a, **kw)
    monkeypatch.setattr(builtins, "__import__", no_xgrammar)
    eng = stories_engine_factory()
    with pytest.raises(pd.InvalidRequestError, match=r"pagedecode\[structured\]"):
        eng.add_request("x", pd.SamplingParams(structured_output=pd.StructuredOutput(regex="a")))


def test_bitmask_in_the_sampling_kernel_equals_the_reference():
    from pagedecode.kernels._backend import HAS_TRITON, interpreting
    from pagedecode.kernels.penalties import PenaltyState, make_penalty_inputs
    from pagedecode.kernels.sampling import make_sampling_inputs, sample
    if not (HAS_TRITON and interpreting()):
        pytest.skip("needs the Triton interpreter")
    g = torch.Generator().manual_seed(3)
    B, V = 5, 333
    logits = torch.randn(B, V, generator=g) * 3
    mask = torch.randint(-2**31, 2**31 - 1, (B, -(-V // 32)), generator=g, dtype=torch.int64).to(torch.int32)
    mask[2] = 0
    mask[2, 3] = 1 << 7                          # one allowed token: 3 * 32 + 7
    inp = make_sampling_inputs([0.0, 0.8, 1.0, 0.7, 1.3], [0, 20, 0, 0, 5], [1.0, 0.9, 1.0, 0.5, 1.0],
                               [0.0, 0.0, 0.0, 0.1, 0.0], [1, 2, 3, 4, 5], [0, 1, 2, 3, 4])
    state = PenaltyState(B, V, "cpu")
    for slot in range(B):
        state.reset(slot, [1, 2, 3], [4, 5], {7: 2.0, 8: -1.0})
    pen = make_penalty_inputs(state, list(range(B)), [1.2] * B, [0.5] * B, [0.3] * B, [True, False, True, True, False], "cpu")
    for penalties in (None, pen):
        ref = sample(logits, inp, backend="torch", penalties=penalties, bitmask=mask)
        tri = sample(logits, inp, backend="triton", penalties=penalties, bitmask=mask)
        assert tri.tokens.tolist() == ref.tokens.tolist()
        assert torch.allclose(tri.logprobs, ref.logprobs, atol=1e-5)
        assert ref.tokens[2].item() == 3 * 32 + 7
        allowed = ((mask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).bool().flatten(1)[:, :V]
        assert all(allowed[i, t] for i, t in enumerate(ref.tokens.tolist()))


def test_a_row_with_no_allowed_token_fails_and_never_samples_token_0(stories_engine_factory, monkeypatch):
    eng = stories_engine_factory()
    so = pd.StructuredOutput(regex="[a-z]{5}")
    eng.generate("x", pd.SamplingParams(max_tokens=1, structured_output=so))
    real_fill = eng.constraints.bitmask.fill

    def empty(matcher, slot):
        real_fill(matcher, slot)
        eng.constraints.bitmask.host[slot] = 0                     # the grammar allows nothing
    monkeypatch.setattr(eng.constraints.bitmask, "fill", empty)
    out, plain = eng.generate(["Once", "Lily"], [pd.SamplingParams(max_tokens=5, structured_output=so),
                                                 pd.SamplingParams(max_tokens=5)])
    assert out.state == S.FAILED and out.finish_reason == R.MODEL_ERROR and "no token" in out.error
    assert out.selected_token_ids == [] and plain.state == S.FINISHED


def test_a_grammar_whose_tokens_logit_bias_bans_fails_that_request_only(stories_engine_factory):
    """Neither the grammar nor the bias alone leaves a row empty; together they do (issue 19, 10f)."""
    from pagedecode.runtime.grammar_compiler import token_bytes_table
    eng = stories_engine_factory()
    table = token_bytes_table(eng.tokenizer, eng.vocab_size)
    starts = {t: -float("inf") for t, b in enumerate(table) if b and b"yes".startswith(b)}
    so = pd.StructuredOutput(choice=["yes"])
    out, biased, plain = eng.generate(["Once", "Once", "Lily"], [
        pd.SamplingParams(max_tokens=5, structured_output=so, logit_bias=starts),
        pd.SamplingParams(max_tokens=5, logit_bias=starts), pd.SamplingParams(max_tokens=5)])
    assert out.state == S.FAILED and out.finish_reason == R.MODEL_ERROR and out.selected_token_ids == []
    assert "logit_bias and the grammar" in out.error
    assert biased.state == plain.state == S.FINISHED


def nested_schema(depth):
    schema = {"const": 1}
    for _ in range(depth):
        schema = {"type": "array", "items": schema, "minItems": 1, "maxItems": 1}
    return schema


def test_schema_limits_refuse_at_add_request_naming_them(stories_engine_factory):
    """A schema nested 400 deep took 3-5 s to parse; 5,000 deep ran out of stack (issue 19)."""
    eng = stories_engine_factory(max_schema_bytes=4096)
    for depth in (65, 400, 5000):
        with pytest.raises(pd.InvalidRequestError, match=f"nests {depth + 1} deep.*max_schema_depth=64"):
            eng.add_request("x", pd.SamplingParams(structured_output=pd.StructuredOutput(json_schema=nested_schema(depth))))
    with pytest.raises(pd.InvalidRequestError, match="choice constraint is .* bytes.*max_schema_bytes=4096"):
        eng.add_request("x", pd.SamplingParams(structured_output=pd.StructuredOutput(
            choice=[f"option {i}" for i in range(1000)])))
    assert not eng.has_unfinished()
    out = eng.generate("x", pd.SamplingParams(max_tokens=200, structured_output=pd.StructuredOutput(
        json_schema=nested_schema(10))))[0]
    assert out.finish_reason == R.GRAMMAR_COMPLETE and json.loads(out.text) == json.loads("[" * 10 + "1" + "]" * 10)
    with pytest.raises(ValueError, match="max_schema_depth"):
        pd.EngineConfig(max_schema_depth=0)


def test_the_compiled_grammar_cache_is_bounded_in_bytes(stories_engine_factory):
    eng = stories_engine_factory(grammar_cache_bytes=70_000)
    sizes = []
    for n in range(4):
        so = pd.StructuredOutput(choice=[f"word{i}x{n}" for i in range(300)])
        out = eng.generate("x", pd.SamplingParams(max_tokens=8, structured_output=so))[0]
        assert out.finish_reason == R.GRAMMAR_COMPLETE and out.text in so.choice
        sizes.append(eng.constraints.compiler.cached_bytes)
    assert max(sizes) <= 70_000 and sizes[0] > 20_000, sizes      # each ~29 KB: the oldest go
    assert len(eng.constraints.compiler._cache) == 2


def test_choices_with_quotes_backslashes_and_non_ascii_are_exact(stories_engine_factory, capfd):
    """choice was a regex of re.escape()d options: xgrammar warned once per escaped space."""
    eng = stories_engine_factory()
    options = ['say "hi" now', "a\\b c", "é😀 x", "tab\there"]
    for i in range(len(options)):
        so = pd.StructuredOutput(choice=options[i:] + options[:i])
        outs = eng.generate(["Once", "Lily"], [pd.SamplingParams(max_tokens=30, structured_output=so),
                                               pd.SamplingParams(max_tokens=30, temperature=1.0, seed=i,
                                                                 structured_output=so)])
        assert all(o.finish_reason == R.GRAMMAR_COMPLETE and o.text in options for o in outs), [o.text for o in outs]
    assert "Warning" not in capfd.readouterr().err
