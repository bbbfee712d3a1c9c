"""Reproductions of what a new user, a reviewer and adversarial workloads broke (issue 7), each
failing on the code before the fix."""
import math

import pytest

import pagedecode as pd
from pagedecode.runtime.finish_rules import check_ending
from pagedecode.testing import ByteVocabTokenizer, ScriptedModel

from .helpers import check_stream, engine, of, run

S, R = pd.RequestState, pd.FinishReason
A, X, Y, Z, BANG, EOS = 10, 11, 12, 13, 14, 2
LETTERS = {1: b"<s>", EOS: b"</s>", A: b"a", X: b"X", Y: b"Y", Z: b"Z", BANG: b"!"}


def letters_engine(script, **config):
    model = ScriptedModel(script, vocab_size=32, eos_token_ids=[EOS])
    config.setdefault("max_cache_tokens", 1024)
    return pd.Engine(model, ByteVocabTokenizer(LETTERS, bos_token_id=1, eos_token_id=EOS), pd.EngineConfig(**config))


# -- stops ------------------------------------------------------------------------------------

def test_stop_token_id_keeps_text_held_only_for_a_stop_string_prefix():
    eng = letters_engine([A, X, BANG, Z])
    out = eng.generate([[A]], pd.SamplingParams(max_tokens=8, stop=["XY"], stop_token_ids=[BANG]))[0]
    assert out.text == "aX" and out.finish_reason == R.STOP_SEQUENCE and out.stop_reason == BANG
    assert out.token_ids == [A, X]


def test_partial_stop_id_sequence_does_not_delay_a_stop_string():
    eng = letters_engine([X, Z, Z])
    out = eng.generate([[A]], pd.SamplingParams(max_tokens=8, stop=["X"], stop_token_ids=[[X, Y]]))[0]
    assert out.selected_token_ids == [X]               # the string ended first: one token, not two
    assert out.text == "" and out.stop_reason == "X"


def test_stop_id_sequence_hit_absorbs_its_tokens_and_sends_what_came_before():
    eng = letters_engine([A, X, Y, Z])
    out = eng.generate([[A]], pd.SamplingParams(max_tokens=8, stop_token_ids=[[X, Y]]))[0]
    assert out.text == "a" and out.token_ids == [A] and out.stop_reason == (X, Y)


# -- the ending function, alone ---------------------------------------------------------------

def make_req(max_tokens=4, ignore_eos=False, out=(), computed=0):
    eng = letters_engine([A])
    rid = eng.add_request([A], pd.SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos))
    req = eng.requests.get(rid)
    req.output_ids.extend(out)
    req.seq.num_computed = computed
    return req


@pytest.mark.parametrize("out, token, stop, ctx, ignore, want", [
    ([A], A, None, 99, False, None),
    ([A, EOS], EOS, None, 99, False, R.EOS),
    ([A, A, A, EOS], EOS, None, 99, False, R.EOS),                  # EOS before length
    ([A, EOS], EOS, None, 99, True, None),                          # ignore_eos
    ([A, X], X, "X", 99, False, R.STOP_SEQUENCE),
    ([A, A, A, X], X, "X", 99, False, R.STOP_SEQUENCE),             # stop before length
    ([A, A, A, A], A, None, 99, False, R.MAX_OUTPUT_TOKENS),
    ([A], A, None, 6, False, R.CONTEXT_LIMIT),                      # cache 5 + 1 >= 6
    ([A], A, None, 7, False, None),
])
def test_check_ending(out, token, stop, ctx, ignore, want):
    req = make_req(ignore_eos=ignore, out=out, computed=5)
    assert check_ending(req, token, stop, frozenset({EOS}), ctx) == want


# -- a transactional step ---------------------------------------------------------------------

def test_sampler_exception_fails_the_step_and_the_engine_serves_on():
    eng = engine([101, 102])
    real = eng.selector.select
    calls = {"n": 0}

    def flaky(logits, reqs, bitmask=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("sampler on fire")
        return real(logits, reqs, bitmask)
    eng.selector.select = flaky
    outs = eng.generate([[5], [6]], pd.SamplingParams(max_tokens=4))      # used to never return
    assert [o.state for o in outs] == [S.FAILED] * 2
    assert all(o.finish_reason == R.MODEL_ERROR and "sampler on fire" in o.error for o in outs)
    assert all(o.usage.selected_tokens == 1 for o in outs)               # the failed step kept nothing
    assert eng.pool.free_pages == eng.pool.num_pages and eng.slots.free_slots == eng.slots.num_slots
    assert eng.generate([[5]], pd.SamplingParams(max_tokens=2))[0].state == S.FINISHED


def test_forward_failure_advances_nothing():
    def boom(info):
        raise RuntimeError("device fault")
    eng = engine([101], on_forward=boom)
    rid = eng.add_request([5, 6, 5], pd.SamplingParams(max_tokens=3))
    run(eng)
    out = eng.result(rid)
    assert out.state == S.FAILED and out.finish_reason == R.MODEL_ERROR
    assert out.usage.processed_tokens == 0 and eng.requests.get(rid).seq.num_computed == 0


def test_detokenizer_exception_fails_only_its_request():
    eng = engine([101])
    a = eng.add_request([5], pd.SamplingParams(max_tokens=3))
    b = eng.add_request([6], pd.SamplingParams(max_tokens=3))

    def broken(token_id):
        raise UnicodeError("decoder on fire")
    eng.requests.get(a).pipeline.detok.add = broken
    run(eng)
    assert eng.result(a).state == S.FAILED and "decoder on fire" in eng.result(a).error
    assert eng.result(b).state == S.FINISHED and eng.result(b).text == "ABABAB"
    assert eng.pool.free_pages == eng.pool.num_pages


class NaNRowModel(ScriptedModel):
    """Emits NaN (or +inf) logits for sequences whose prompt starts with `poisoned`, without raising."""

    def __init__(self, value, **kw):
        super().__init__([101], vocab_size=200, eos_token_ids=[2], **kw)
        self.value = value

    def forward(self, batch, kv):
        logits = super().forward(batch, kv)
        for row, s in enumerate(batch.logits_seqs):
            if batch.token_ids[s][0] == 6:
                logits[row, 7] = self.value
        return logits


@pytest.mark.parametrize("value, temperature", [(math.nan, 0.0), (math.inf, 0.0), (math.nan, 0.7)])
def test_non_finite_logits_fail_that_request_only(value, temperature):
    from .helpers import tokenizer
    eng = pd.Engine(NaNRowModel(value), tokenizer(), pd.EngineConfig(max_cache_tokens=512))
    outs = eng.generate([[5], [6], [5]], pd.SamplingParams(max_tokens=3, temperature=temperature, seed=1))
    assert outs[1].state == S.FAILED and outs[1].finish_reason == R.MODEL_ERROR
    assert "non-finite logits" in outs[1].error and outs[1].selected_token_ids == []
    assert [o.state for o in (outs[0], outs[2])] == [S.FINISHED] * 2 and outs[0].text == "ABABAB"


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.9, seed=3), dict(logprobs=2)])
def test_a_row_with_nothing_allowed_fails_that_request_only(stories_engine_factory, backend, sampling):
    """Bias -inf on every id used to finish normally with token 0 repeated, and min_tokens=3 with
    all but EOS banned emitted three banned tokens (issue 19, 10f)."""
    from pagedecode.kernels._backend import HAS_TRITON, interpreting
    if backend == "triton" and not (HAS_TRITON and interpreting()):
        pytest.skip("needs the Triton interpreter")
    eng = stories_engine_factory(sampling_backend=backend)
    eos = min(eng.eos_ids)
    plain = pd.SamplingParams(max_tokens=4, **sampling)
    alone = eng.generate("Lily", plain)[0].selected_token_ids
    everything = pd.SamplingParams(max_tokens=4, logit_bias={t: -math.inf for t in range(eng.vocab_size)}, **sampling)
    all_but_eos = pd.SamplingParams(max_tokens=4, min_tokens=3, **sampling,
                                    logit_bias={t: -math.inf for t in range(eng.vocab_size) if t != eos})
    banned, masked, ok = eng.generate(["Once", "Once", "Lily"], [everything, all_but_eos, plain])
    for out, why in ((banned, "logit_bias"), (masked, "min_tokens=3")):
        assert out.state == S.FAILED and out.finish_reason == R.MODEL_ERROR, (out.state, out.token_ids)
        assert "no token is allowed at output position 1" in out.error and why in out.error
        assert out.selected_token_ids == []
    assert ok.state == S.FINISHED and ok.selected_token_ids == alone


def test_huge_top_k_is_disabled_not_an_exception():
    eng = engine([101])
    outs = eng.generate([[5], [6]], [pd.SamplingParams(max_tokens=2, temperature=1.0, top_k=2**31 - 1, seed=3),
                                     pd.SamplingParams(max_tokens=2)])
    assert [o.state for o in outs] == [S.FINISHED] * 2
    with pytest.raises(pd.InvalidRequestError, match="top_k"):
        pd.SamplingParams(top_k=10**12)


def test_backends_are_validated_and_reach_a_model_object(stories_path):
    for name in ("attention_backend", "sampling_backend"):
        with pytest.raises(ValueError, match=name):
            pd.EngineConfig(**{name: "tritn"})
    model, tok = pd.load_model(stories_path)
    assert model.attention_backend == "auto"
    pd.Engine(model, tok, pd.EngineConfig(attention_backend="torch"))
    assert model.attention_backend == "torch"


# -- one owner per resource ---------------------------------------------------------------------


def test_cancel_requested_is_a_state_until_the_safe_point():
    eng = engine([101])
    rid = eng.add_request([5], pd.SamplingParams(max_tokens=5))
    eng.step()
    assert eng.cancel(rid)
    assert eng.result(rid).state == S.CANCEL_REQUESTED
    assert eng.cancel(rid)                                # idempotent while it lasts
    eng.step()
    assert eng.result(rid).state == S.CANCELLED and not eng.cancel(rid)


# -- input that is malformed, field by field ---------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("stop_token_ids", 5), ("stop_token_ids", "5"), ("stop_token_ids", [[]]), ("stop_token_ids", [-1]),
    ("stop_token_ids", [1.5]), ("stop", 5), ("stop", [5]), ("stop", [""]), ("max_tokens", "3"),
    ("max_tokens", 0), ("max_tokens", True), ("max_tokens", 2**40), ("temperature", "hot"),
    ("temperature", math.nan), ("temperature", -1), ("top_k", -1), ("top_k", 1.5), ("top_p", 0),
    ("top_p", 1.5), ("min_p", 2), ("repetition_penalty", 0), ("repetition_penalty", 1e300),
    ("presence_penalty", 3), ("frequency_penalty", math.inf), ("logit_bias", [1, 2]),
    ("logit_bias", {"a": 1}), ("logit_bias", {1: math.nan}), ("logit_bias", {1: 1e300}),
    ("logit_bias", {-1: 1}), ("seed", -1), ("seed", 2**64), ("seed", "1"), ("min_tokens", -1),
    ("logprobs", 21), ("logprobs", True), ("deadline_s", 0), ("deadline_s", math.inf), ("utf8_errors", "x"),
    ("ignore_eos", 1), ("skip_special_tokens", None), pytest.param("temperature", 10**400, id="temperature-1e400"),
    pytest.param("top_p", -10**400, id="top_p-minus-1e400"),
    pytest.param("seed", 10**5000, id="seed-5000-digits"), ("stop", "\ud800"), ("stop", ["ok", "a\udfff"]),
    ("cache_salt", "\udbff"),
])
def test_every_malformed_field_is_named(field, value):
    with pytest.raises(pd.InvalidRequestError, match=field):
        pd.SamplingParams(**{field: value})


@pytest.mark.parametrize("prompt", [[], "", [1.0], [True], [-1], [10**6], None, 5, b"bytes", [[1]]])
def test_malformed_prompts_are_rejected_and_nothing_leaks(prompt):
    eng = engine([101])
    with pytest.raises(pd.InvalidRequestError):
        eng.add_request(prompt, pd.SamplingParams())
    assert not eng.has_unfinished() and eng.requests.num_finished == 0


@pytest.mark.parametrize("request_id", ["r" * 257, "a\ud800b", "\udfff"])
def test_request_ids_over_256_characters_or_not_unicode_are_refused(request_id):
    eng = engine([101])
    with pytest.raises(pd.InvalidRequestError, match="request_id"):
        eng.add_request([5], pd.SamplingParams(max_tokens=1), request_id=request_id)
    assert not eng.has_unfinished() and eng.requests.num_finished == 0
    eng.add_request([5], pd.SamplingParams(max_tokens=1), request_id="r" * 256)      # the longest allowed
    run(eng)


def test_a_prompt_with_a_lone_surrogate_is_refused_saying_so():
    eng = engine([101])
    with pytest.raises(pd.InvalidRequestError, match="lone surrogate"):
        eng.add_request("ab\ud800", pd.SamplingParams())
    assert not eng.has_unfinished()


def test_automatic_ids_never_collide_with_chosen_ones():
    eng = engine([101])
    eng.add_request([5], pd.SamplingParams(max_tokens=1), request_id="req-0")
    auto = eng.add_request([5], pd.SamplingParams(max_tokens=1))       # used to be refused
    assert auto != "req-0"
    run(eng)
    eng.add_request([5], pd.SamplingParams(max_tokens=3), request_id="req-9")
    run(eng)
    kept = eng.result("req-9")
    ids = [eng.add_request([6], pd.SamplingParams(max_tokens=1)) for _ in range(12)]
    assert "req-9" not in ids and eng.result("req-9") == kept        # never silently replaced
    run(eng)


def test_generate_with_a_bad_request_reserves_no_ids():
    eng = engine([101])
    with pytest.raises(pd.InvalidRequestError):
        eng.generate([[5], [10**6]], pd.SamplingParams())
    assert not eng.has_unfinished()


# -- whatever a free or unwritten KV slot holds never reaches a result --------------------------

@pytest.mark.parametrize("poison", [math.nan, math.inf, 1e30])
def test_poisoned_free_pages_do_not_change_batched_greedy_outputs(stories_engine_factory, poison):
    prompts = ["Once upon a time", "Lily", "The cat sat on the mat and", "Tom", "A", "She was happy"]
    params = pd.SamplingParams(max_tokens=12)
    clean = [o.token_ids for o in stories_engine_factory(page_size=4).generate(prompts, params)]
    eng = stories_engine_factory(page_size=4)
    eng.kv.k.fill_(poison)
    eng.kv.v.fill_(poison)
    assert [o.token_ids for o in eng.generate(prompts, params)] == clean


def test_poisoned_freed_pages_between_steps(stories_engine_factory):
    """Pages freed by finished requests are poisoned after every step; later requests that
    reuse them, and requests running beside them, are unchanged."""
    prompts = ["Once upon a time"] * 2 + ["Lily and Tom went to", "The dog"] * 2
    lens = [3, 9, 14, 6, 11, 5]
    params = [pd.SamplingParams(max_tokens=n) for n in lens]
    clean = [o.token_ids for o in stories_engine_factory(page_size=4, max_batch_size=3).generate(prompts, params)]
    eng = stories_engine_factory(page_size=4, max_batch_size=3)
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    while eng.has_unfinished():
        eng.step()
        free = [p for p, c in enumerate(eng.pool.ref_counts) if c == 0 and p not in eng.pool.page_hash]
        eng.kv.k[:, free] = math.nan
        eng.kv.v[:, free] = math.nan
    assert [eng.result(r).token_ids for r in rids] == clean


# -- tokenizers users already have ------------------------------------------------------------

def test_engine_accepts_the_tokenizers_users_have(stories_path):
    from tokenizers import Tokenizer as HFTokenizer
    transformers = pytest.importorskip("transformers")
    model, tok = pd.load_model(stories_path)
    want = pd.Engine(model, tok).generate("Once upon a time", pd.SamplingParams(max_tokens=8))[0].text
    for given in (HFTokenizer.from_file(str(stories_path / "tokenizer.json")),
                  transformers.AutoTokenizer.from_pretrained(stories_path), stories_path, str(stories_path)):
        eng = pd.Engine(model, given)
        assert isinstance(eng.tokenizer, pd.TokenizerLike)
        assert eng.generate("Once upon a time", pd.SamplingParams(max_tokens=8))[0].text == want
    for bad in (object(), 42, {"vocab": 1}):
        with pytest.raises(TypeError, match="tokenizer"):
            pd.Engine(model, bad)
    with pytest.raises(TypeError, match="pd.Model"):
        pd.Engine(object(), tok)


def test_encode_without_special_tokens_adds_no_second_bos(stories_path):
    tok = pd.Tokenizer.from_dir(stories_path)
    assert tok.encode("Hi")[0] == tok.bos_token_id
    rendered = "<s>Hi"
    ids = tok.encode(rendered, add_special_tokens=False)
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    assert tok.encode("Hi", add_special_tokens=False)[0] != tok.bos_token_id


# -- the stream contract still holds after all this --------------------------------------------

def test_contract_holds_with_the_new_pipeline():
    eng = engine([101, 102, 103, 2])
    rid = eng.add_request([5], pd.SamplingParams(max_tokens=8, stop=["DE"]))
    events = run(eng)
    check_stream(events, rid)
    assert eng.result(rid).text == "ABC" and of(events, rid)[-1].finish_reason == R.STOP_SEQUENCE


def test_scripted_and_llama_models_satisfy_the_protocol(stories_path):
    model, _ = pd.load_model(stories_path)
    assert isinstance(model, pd.Model) and isinstance(ScriptedModel([1], vocab_size=4), pd.Model)
    assert not isinstance(object(), pd.Model)


def test_stories_prompt_ending_in_an_emoji_run(stories_engine_factory):
    """Reproduction: the prompt's byte-fallback run used to be handed to the output again."""
    eng = stories_engine_factory()
    out = eng.generate("The cat 🐱🐶", pd.SamplingParams(max_tokens=10))[0]
    full = eng.tokenizer.decode(out.prompt_token_ids + out.selected_token_ids)
    assert full.startswith("The cat 🐱🐶") and out.text == full[len("The cat 🐱🐶"):]
    assert not out.text.startswith("🐱")
