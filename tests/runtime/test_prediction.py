"""Predicted Outputs (runtime/spec/prediction.py) and the quantized self-draft: the prediction's
tokens and a quantized copy of the model are draft sources like any other, so every request's
tokens, text, logprobs and endings are the ones the plain engine gives; only the speed and the
draft counts differ."""
from dataclasses import replace

import pytest

import pagedecode as pd
from pagedecode.runtime.spec.prediction import PredictionCursor

R = pd.FinishReason


def outputs(eng, prompts, params):
    return [(o.token_ids, o.text, o.logprobs, o.top_logprobs, o.finish_reason, o.selected_token_ids)
            for o in eng.generate(prompts, params)]


# -- the cursor ------------------------------------------------------------------------------------

def test_cursor_follows_the_prediction_token_for_token():
    c = PredictionCursor([10, 11, 12, 13, 14, 15])
    assert c.propose([], 3) == [10, 11, 12]
    assert c.propose([10, 11], 3) == [12, 13, 14]
    assert c.propose([10, 11, 12, 13, 14], 4) == [15]
    assert c.propose([10, 11, 12, 13, 14, 15], 4) == []            # at its end: nothing left


def test_cursor_resynchronises_after_an_edit():
    pred = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    c = PredictionCursor(pred)
    assert c.propose([1, 2, 3], 2) == [4, 5]
    out = [1, 2, 3, 40, 50]                                          # 4 5 replaced: lost
    assert c.propose(out, 2) == []
    out += [6, 7]                                                    # "50 6 7": 2 tokens of the prediction
    assert c.propose(out, 2) == []                                   # fewer than MIN_ANCHOR
    out += [8]                                                       # "6 7 8" is found: on after it
    assert c.propose(out, 3) == [9, 10, 11]
    assert c.propose(out + [9, 10], 3) == [11, 12]                   # and follows again


def test_cursor_resyncs_forward_first_when_the_prediction_repeats_itself():
    line = [7, 8, 9]
    pred = [1] + line + [2] + line + [3] + line + [4]
    c = PredictionCursor(pred)
    out = [1] + line + [2] + line                                    # followed through the second copy
    assert c.propose(out, 1) == [3]
    out += [99] + line                                               # an edit, then the third copy's text
    assert c.propose(out, 1) == [4]                                  # after the third copy, not the first


def test_cursor_ignores_matches_inside_a_token():
    c = PredictionCursor([256, 0, 5, 9, 1, 2, 3, 4])
    assert c.propose([77, 1, 2, 3], 1) == [4]
    c = PredictionCursor([256, 1, 2])       # int64 bytes of 256 hold token 1's at an odd offset
    assert c.propose([5, 1, 0, 0], 1) == []


# -- the engine ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain_story(stories_path):
    eng = pd.Engine.from_pretrained(stories_path)
    out = eng.generate("Once upon a time", pd.SamplingParams(max_tokens=48))[0]
    return out.text, out.token_ids


PARAMS = [pd.SamplingParams(max_tokens=48, logprobs=2),
          pd.SamplingParams(max_tokens=48, temperature=0.9, seed=5, logprobs=1),
          pd.SamplingParams(max_tokens=48, repetition_penalty=1.3, presence_penalty=0.5)]


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_prediction_leaves_every_token_as_the_plain_engine_makes_it(stories_engine_factory, plain_story,
                                                                      deterministic):
    text, ids = plain_story
    edited = text.replace(" the ", " a big ", 2)                     # a prediction with edits in it
    plain = outputs(stories_engine_factory(deterministic=deterministic), ["Once upon a time"] * 3, PARAMS)
    eng = stories_engine_factory(deterministic=deterministic)
    for prediction in (text, edited, list(ids)):
        got = outputs(eng, ["Once upon a time"] * 3, [replace(p, prediction=prediction) for p in PARAMS])
        if deterministic:
            assert got == plain                  # logprobs too, to the bit
            continue
        # the default mode keeps every token, text and ending; logprobs up to the verify rows'
        # summation order (docs/speculative.md; test_spec_gates.py states the same for drafts)
        assert [(g[0], g[1], g[4], g[5]) for g in got] == [(w[0], w[1], w[4], w[5]) for w in plain]
        for g, w in zip(got, plain):
            assert g[2] == pytest.approx(w[2], abs=1e-4)
    usage = eng.generate("Once upon a time", replace(PARAMS[0], prediction=list(ids)))[0].usage
    assert usage.accepted_draft_tokens == usage.draft_tokens >= 32     # the ids: every draft taken


def test_the_exact_prediction_is_accepted_whole_and_saves_steps(stories_engine_factory, plain_story):
    text, ids = plain_story
    eng = stories_engine_factory()
    out = eng.generate("Once upon a time", pd.SamplingParams(max_tokens=48, prediction=text))[0]
    assert out.token_ids == ids
    assert out.usage.accepted_draft_tokens == out.usage.draft_tokens >= 32
    # a prediction's runs are PREDICTION_DRAFT long from the first (they need not earn it): the
    # prefill, two plain steps (the text's first token encodes unlike the output's: the cursor
    # re-synchronises on 3 of them) and 3 runs of up to 17 tokens; earned (2, 4, 8, 16, ...) they
    # took 8 steps, and runs of at most k = 4 drafts take at least 48 / 5 steps after the prefill
    assert eng.steps <= 6


def test_after_an_edit_the_prediction_drafts_whole_runs_again(stories_engine_factory, plain_story):
    """A divergence costs one run: once the output is found in the prediction again, the next run
    proposes PREDICTION_DRAFT drafts, not 2 growing back to 16."""
    from pagedecode.runtime.spec.gates import PREDICTION_DRAFT
    text, ids = plain_story
    plain = stories_engine_factory().generate("Once upon a time", pd.SamplingParams(max_tokens=96))[0]
    cut = len(plain.token_ids) // 3
    # the output's tokens with one changed a third of the way in: the prediction of an edit
    edited = list(plain.token_ids[:cut]) + [plain.token_ids[cut] + 1] + list(plain.token_ids[cut + 1:])
    eng = stories_engine_factory(trace="tokens")
    rid = eng.add_request("Once upon a time", pd.SamplingParams(max_tokens=96, prediction=edited))
    while eng.has_unfinished():
        eng.step()
    assert eng.result(rid).token_ids == plain.token_ids
    runs = [(r["proposed"], r["accepted"]) for r in eng.trace(rid) if r["kind"] == "spec.verify"]
    missed = next(i for i, (p, a) in enumerate(runs) if a < p)
    assert runs[0][0] == PREDICTION_DRAFT
    # after the miss: the request's own tokens (prompt lookup) until the cursor re-synchronises,
    # then a whole run of the prediction
    assert any(p == PREDICTION_DRAFT for p, _ in runs[missed + 1:]), runs


def test_off_the_prediction_a_request_drafts_from_its_own_tokens(stories_engine_factory):
    """Past the prediction's end (and after an edit, until it re-synchronises) the request drafts
    from its own tokens, as prompt lookup does; the usage counts only the prediction's drafts."""
    plain = stories_engine_factory().generate("Once upon a time", pd.SamplingParams(max_tokens=96))[0]
    half = plain.text[:len(plain.text) // 3]
    for deterministic in (False, True):
        eng = stories_engine_factory(deterministic=deterministic)
        out = eng.generate("Once upon a time", pd.SamplingParams(max_tokens=96, prediction=half))[0]
        assert (out.token_ids, out.text, out.finish_reason) == (plain.token_ids, plain.text, plain.finish_reason)
        u = out.usage
        from_prediction = u.accepted_prediction_tokens + u.rejected_prediction_tokens
        assert u.accepted_prediction_tokens >= 16               # the third the prediction holds
        assert u.draft_tokens > from_prediction                 # and drafts of its own after it


def test_a_request_without_prediction_is_not_speculated_on(stories_engine_factory, plain_story):
    """Speculation off: only the predicted request drafts; the other in the same batch decodes."""
    text, _ = plain_story
    eng = stories_engine_factory()
    outs = eng.generate(["Once upon a time", "Once upon a time"],
                        [pd.SamplingParams(max_tokens=32, prediction=text), pd.SamplingParams(max_tokens=32)])
    assert outs[0].token_ids == outs[1].token_ids
    assert outs[0].usage.draft_tokens > 0 and outs[1].usage.draft_tokens == 0


def test_prediction_beside_ngram_speculation_and_a_grammar(stories_engine_factory, plain_story):
    text, _ = plain_story
    want = outputs(stories_engine_factory(), ["Once upon a time"], [pd.SamplingParams(max_tokens=40)])
    ngram = stories_engine_factory(speculative=pd.SpeculativeConfig(method="ngram", min_gain=0.0))
    assert outputs(ngram, ["Once upon a time"], [pd.SamplingParams(max_tokens=40, prediction=text)]) == want
    choice = pd.StructuredOutput(choice=["Once upon a time there was", "The cat"])
    want = outputs(stories_engine_factory(), ["Hi"], [pd.SamplingParams(max_tokens=20, structured_output=choice)])
    got = outputs(stories_engine_factory(), ["Hi"], [pd.SamplingParams(max_tokens=20, structured_output=choice,
                                                                        prediction="Once upon a time there was")])
    assert got == want


@pytest.mark.parametrize("bad", [5, [1, -2], ["a"], [True], "\ud800", {"type": "content"}])
def test_a_bad_prediction_is_refused_naming_the_field(bad):
    with pytest.raises(pd.InvalidRequestError, match="prediction"):
        pd.SamplingParams(prediction=bad)


def test_prediction_ids_outside_the_vocabulary_are_refused(stories_engine_factory):
    eng = stories_engine_factory()
    with pytest.raises(pd.InvalidRequestError, match="prediction"):
        eng.add_request("Once", pd.SamplingParams(prediction=[1, eng.vocab_size]))
    assert not eng.has_unfinished()


# -- the quantized self-draft ----------------------------------------------------------------------

@pytest.mark.parametrize("quantization", ["q8_0", "q4_0"])
def test_self_draft_quantized_keeps_the_plain_tokens(stories_engine_factory, quantization):
    prompts = ["Once upon a time", "Lily and Tom"]
    params = [pd.SamplingParams(max_tokens=32), pd.SamplingParams(max_tokens=32, repetition_penalty=1.2)]
    want = outputs(stories_engine_factory(), prompts, params)
    spec = pd.SpeculativeConfig(method="draft", draft_quantization=quantization, min_gain=0.0)
    eng = stories_engine_factory(speculative=spec)
    assert eng.speculator.draft is not None and eng.speculator.draft.model.quantized
    assert eng.speculator.draft.kv is eng.kv                  # it drafts on the target's own cache
    assert eng.speculator.draft.model.weight_bytes < 0.5 * eng.model.weight_bytes
    outs = eng.generate(prompts, params)
    assert [(o.token_ids, o.text, o.logprobs, o.top_logprobs, o.finish_reason, o.selected_token_ids)
            for o in outs] == want
    assert sum(o.usage.accepted_draft_tokens for o in outs) > 0.5 * sum(o.usage.draft_tokens for o in outs) > 0


@pytest.mark.parametrize("deterministic", [False, True])
def test_self_draft_with_prompt_lookup_keeps_the_plain_tokens(stories_engine_factory, deterministic):
    """prompt_lookup: a request whose own tokens hold an n-gram match drafts from it, the draft
    model for the others, each source under its own gate; the tokens are the plain engine's."""
    prompts = ["Once upon a time", "Lily and Tom",          # the third copies its prompt: lookup finds it
               "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
               "Once upon a time, there"]
    params = [pd.SamplingParams(max_tokens=40), pd.SamplingParams(max_tokens=40, repetition_penalty=1.2),
              pd.SamplingParams(max_tokens=40, logprobs=1)]
    want = outputs(stories_engine_factory(deterministic=deterministic), prompts, params)
    spec = pd.SpeculativeConfig(method="draft", draft_quantization="q8_0", prompt_lookup=True, min_gain=0.0)
    eng = stories_engine_factory(speculative=spec, deterministic=deterministic)
    got = outputs(eng, prompts, params)
    if deterministic:
        assert got == want
    else:
        assert [(g[0], g[1], g[4], g[5]) for g in got] == [(w[0], w[1], w[4], w[5]) for w in want]
    c = eng.speculator.counters
    assert 0 < c.lookup_tokens < c.draft_tokens                # both sources drafted
    with pytest.raises(ValueError, match="prompt_lookup"):
        pd.SpeculativeConfig(method="ngram", prompt_lookup=True)


def test_self_draft_needs_a_checkpoint(stories_engine_factory):
    eng = stories_engine_factory()
    spec = pd.SpeculativeConfig(method="draft", draft_quantization="q4_0")
    with pytest.raises(ValueError, match="from_pretrained"):
        pd.Engine(eng.model, eng.tokenizer, pd.EngineConfig(speculative=spec))
    with pytest.raises(ValueError, match="draft_quantization"):
        pd.SpeculativeConfig(method="draft", draft_quantization="q3_x")
    with pytest.raises(ValueError, match="only for"):
        pd.SpeculativeConfig(method="ngram", draft_quantization="q4_0")
