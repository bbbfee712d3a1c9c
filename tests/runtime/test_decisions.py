"""Every row of docs/design.md's "Decisions" table."""
import math

import pytest

import pagedecode as pd

from .helpers import EOS, check_stream, engine, of, run


def test_eos_as_the_max_tokens_th_token_is_eos():
    eng = engine([101, 102, EOS])
    rid = eng.add_request([5], pd.SamplingParams(max_tokens=3))
    run(eng)
    out = eng.result(rid)
    assert out.finish_reason == pd.FinishReason.EOS
    assert out.selected_token_ids == [101, 102, EOS] and out.token_ids == [101, 102]
    assert out.usage.selected_tokens == 3 and out.usage.returned_tokens == 2


def test_ignore_eos_keeps_going():
    eng = engine([EOS])
    rid = eng.add_request([5], pd.SamplingParams(max_tokens=4, ignore_eos=True))
    run(eng)
    out = eng.result(rid)
    assert out.finish_reason == pd.FinishReason.MAX_OUTPUT_TOKENS and out.selected_token_ids == [EOS] * 4
    assert out.text == ""                       # EOS is never shown


def test_cancel_observed_before_the_finishing_selection_wins():
    rid = None

    def on_forward(info):
        b = info["batch"]
        if rid in b.request_ids and len(b.output_ids[b.request_ids.index(rid)]) == 1:
            eng.cancel(rid)                    # the step that would select token 2 = max_tokens

    eng = engine([101, 102], on_forward=on_forward)
    rid = eng.add_request([5], pd.SamplingParams(max_tokens=2))
    run(eng)
    out = eng.result(rid)
    assert out.state == pd.RequestState.CANCELLED and out.selected_token_ids == [101]


def test_cancel_after_the_finish_is_fixed_is_refused():
    eng = engine([101])
    rid = eng.add_request([5], pd.SamplingParams(max_tokens=1))
    run(eng)
    assert eng.result(rid).state == pd.RequestState.FINISHED
    assert eng.cancel(rid) is False
    assert eng.cancel("never-added") is False


def test_stop_string_straddling_prompt_and_output_never_matches():
    eng = engine([102, 103])
    rid = eng.add_request([101], pd.SamplingParams(max_tokens=2, stop=["BC"]))   # prompt "AB"
    run(eng)
    out = eng.result(rid)
    assert out.text == "CDEF" and out.finish_reason == pd.FinishReason.MAX_OUTPUT_TOKENS


@pytest.mark.parametrize("stops,text,reason", [
    (["BCD", "ABC", "CD"], "", "ABC"),          # earliest end wins
    (["CD", "BCD"], "A", "BCD"),                # same end: the longest
    (["CD", "CD"], "AB", "CD"),                 # then list order
    (["EF", "ABCDX"], "ABCD", "EF"),            # a longer stop still open does not block a hit
])
def test_several_stops_in_one_step(stops, text, reason):
    eng = engine(lambda prompt, out: [101, 102, 103][len(out)] if len(out) < 3 else 5)
    eng.tokenizer.vocab[130] = b"ABCD"
    rid = eng.add_request([5], pd.SamplingParams(max_tokens=3, stop=stops))
    if stops[0] != "EF":
        eng.model.script = lambda prompt, out: 130
    run(eng)
    out = eng.result(rid)
    assert out.text == text and out.stop_reason == reason
    assert out.finish_reason == pd.FinishReason.STOP_SEQUENCE


def test_stop_text_excluded_unless_asked():
    for include, want in ((False, "A"), (True, "ABCD")):
        eng = engine([101, 102, 103])
        rid = eng.add_request([5], pd.SamplingParams(max_tokens=5, stop="BCD", include_stop_str_in_output=include))
        events = run(eng)
        assert eng.result(rid).text == want
        assert "".join(d.text for d in of(events, rid, pd.DeltaEvent)) == want


def test_hold_back_is_prefix_aware_and_minimal():
    eng = engine([101, 102, 101, 104, 5])
    rid = eng.add_request([5], pd.SamplingParams(max_tokens=5, stop=["ABX", "BBB"]))
    per_step = []
    while eng.has_unfinished():
        per_step.append("".join(e.text for e in eng.step() if isinstance(e, pd.DeltaEvent)))
    # "AB" is a prefix of "ABX": held. "ABCD" is not a prefix of any stop: all released.
    # "AB" held again, then "ABB" -> "BB" could start "BBB": only "A" sent; "x" ends it
    assert [s for s in per_step if s] == ["ABCD", "A", "BBx"]
    assert eng.result(rid).text == "ABCDABBx"


def test_held_text_is_flushed_at_a_normal_end():
    eng = engine([101])
    rid = eng.add_request([5], pd.SamplingParams(max_tokens=1, stop=["ABX"]))
    run(eng)
    assert eng.result(rid).text == "AB" and eng.result(rid).finish_reason == pd.FinishReason.MAX_OUTPUT_TOKENS


def test_utf8_tail_fails_by_default_and_is_replaced_on_request():
    # " café" then half of "€": max_tokens ends inside the character
    for policy, state, text in (("strict", pd.RequestState.FAILED, " café"),
                                ("replace", pd.RequestState.FINISHED, " café\ufffd")):
        eng = engine([120, 121, 122])
        rid = eng.add_request([5], pd.SamplingParams(max_tokens=2, utf8_errors=policy))
        events = run(eng)
        out = eng.result(rid)
        assert out.state == state and out.text == text
        assert out.selected_token_ids == [120, 121]              # never generated past max_tokens
        if policy == "strict":
            assert out.finish_reason == pd.FinishReason.CONTENT_INTERRUPTED
            assert "UTF-8" in out.error
        check_stream(events, rid)
    eng = engine([120, 121, 122])
    rid = eng.add_request([5], pd.SamplingParams(max_tokens=3))
    run(eng)
    assert eng.result(rid).text == " café€"


def test_a_split_character_is_never_half_sent():
    eng = engine([110, 111, 101])
    rid = eng.add_request([5], pd.SamplingParams(max_tokens=3))
    events = run(eng)
    deltas = of(events, rid, pd.DeltaEvent)
    assert [(d.text, d.token_ids) for d in deltas] == [("é", (110, 111)), ("AB", (101,))]


def test_prompt_ending_inside_a_character_gives_the_character_to_the_output():
    eng = engine([111, 101])
    rid = eng.add_request([5, 110], pd.SamplingParams(max_tokens=2))     # prompt "x" + b"\xc3"
    run(eng)
    assert eng.result(rid).text == "éAB"


@pytest.mark.parametrize("bad", [
    dict(prompt=[5], params=dict(max_tokens=0)),
    dict(prompt="", params={}),
    dict(prompt=[], params={}),
    dict(prompt=[5], params=dict(temperature=-0.5)),
    dict(prompt=[5], params=dict(temperature=math.nan)),
    dict(prompt=[5], params=dict(temperature=math.inf)),
    dict(prompt=[5], params=dict(top_p=0.0)),
    dict(prompt=[5], params=dict(top_p=1.5)),
    dict(prompt=[5], params=dict(top_k=-1)),
    dict(prompt=[5], params=dict(min_p=2.0)),
    dict(prompt=[5], params=dict(max_tokens=3, min_tokens=4)),
    dict(prompt=[5], params=dict(stop=[""])),
    dict(prompt=[5], params=dict(stop=[str(i) for i in range(17)])),
    dict(prompt=[5], params=dict(stop=["x" * 300])),
    dict(prompt=[5], params=dict(stop=[3])),
    dict(prompt=[5], params=dict(stop_token_ids=[[]])),
    dict(prompt=[5], params=dict(stop_token_ids=[-1])),
    dict(prompt=[5], params=dict(stop_token_ids=[999])),
    dict(prompt=[5], params=dict(logit_bias={999: 1.0})),
    dict(prompt=[5], params=dict(logit_bias={5: math.nan})),
    dict(prompt=[5], params=dict(repetition_penalty=0.0)),
    dict(prompt=[5], params=dict(presence_penalty=3.0)),
    dict(prompt=[5], params=dict(seed=-1)),
    dict(prompt=[5], params=dict(logprobs=-1)),
    dict(prompt=[5], params=dict(deadline_s=0)),
    dict(prompt=[5], params=dict(utf8_errors="ignore")),
    dict(prompt=[5], params=dict(max_tokens=True)),
    dict(prompt=[5, 200], params={}),
    dict(prompt=[5, -1], params={}),
    dict(prompt=[5, "a"], params={}),
    dict(prompt=5, params={}),
    dict(prompt="\u2603", params={}),                        # the tokenizer has no token for it
    dict(prompt=list(range(3, 70)), params={}),              # longer than the context of 64
])
def test_invalid_requests_are_rejected_and_nothing_leaks(bad):
    eng = engine([101], max_context=64)
    free = eng.pool.free_pages
    with pytest.raises(pd.InvalidRequestError):
        eng.add_request(bad["prompt"], pd.SamplingParams(**bad["params"]))
    assert not eng.has_unfinished() and eng.pool.free_pages == free
    assert eng.step() == []
    rid = eng.add_request([5], pd.SamplingParams(max_tokens=2))      # the engine is unaffected
    run(eng)
    assert eng.result(rid).text == "ABAB"


def test_live_duplicate_id_rejected_and_reuse_after_terminal():
    eng = engine([101])
    eng.add_request([5], pd.SamplingParams(max_tokens=2), request_id="r")
    with pytest.raises(pd.InvalidRequestError, match="still live"):
        eng.add_request([6], pd.SamplingParams(max_tokens=2), request_id="r")
    run(eng)
    eng.add_request([6], pd.SamplingParams(max_tokens=1), request_id="r")
    run(eng)
    out = eng.result("r")
    assert out.prompt_token_ids == [6] and out.text == "AB"
    with pytest.raises(pd.InvalidRequestError):
        eng.add_request([5], request_id="")
    with pytest.raises(pd.InvalidRequestError):
        eng.add_request([5], params={"max_tokens": 3})


def test_generate_checks_every_request_before_queuing_any():
    eng = engine([101])
    with pytest.raises(pd.InvalidRequestError):
        eng.generate([[5], [5, 999]], pd.SamplingParams(max_tokens=2))
    assert not eng.has_unfinished()


@pytest.mark.parametrize("prompt_len,n_out", [(16, 1), (15, 1), (14, 2), (10, 6)])
def test_context_limit(prompt_len, n_out):
    """cache length + 1 >= C ends the request: a prompt of C or C-1 tokens gets one token."""
    eng = engine([101], max_context=16)
    rid = eng.add_request([5] * prompt_len, pd.SamplingParams(max_tokens=50))
    run(eng)
    out = eng.result(rid)
    assert len(out.selected_token_ids) == n_out
    assert out.finish_reason == pd.FinishReason.CONTEXT_LIMIT
    with pytest.raises(pd.InvalidRequestError, match="context limit"):
        eng.add_request([5] * 17)


def test_min_tokens_masks_eos_and_stop_ids_and_defers_stop_strings():
    eng = engine([EOS])                                 # the model wants to stop at once
    rid = eng.add_request([5], pd.SamplingParams(max_tokens=10, min_tokens=3))
    run(eng)
    out = eng.result(rid)
    assert len(out.selected_token_ids) == 4 and out.selected_token_ids[:3].count(EOS) == 0
    assert out.finish_reason == pd.FinishReason.EOS
    eng = engine([103])
    rid = eng.add_request([5], pd.SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=[103]))
    run(eng)
    assert 103 not in eng.result(rid).selected_token_ids[:2]
    eng = engine([101])
    rid = eng.add_request([5], pd.SamplingParams(max_tokens=10, min_tokens=1, stop=["AB"]))
    run(eng)
    out = eng.result(rid)
    assert out.text == "AB" and out.selected_token_ids == [101, 101]   # the first "AB" could not stop it


def test_stop_token_id_sequences():
    eng = engine([101, 102, 101, 103, 102])
    rid = eng.add_request([5], pd.SamplingParams(max_tokens=10, stop_token_ids=[[101, 103], 999 - 900]))
    events = run(eng)
    out = eng.result(rid)
    assert out.finish_reason == pd.FinishReason.STOP_SEQUENCE and out.stop_reason == (101, 103)
    assert out.text == "ABCD" and out.token_ids == [101, 102]
    assert "".join(d.text for d in of(events, rid, pd.DeltaEvent)) == "ABCD"
    eng = engine([101, 102, 103])
    rid = eng.add_request([5], pd.SamplingParams(max_tokens=5, stop_token_ids=[102]))
    run(eng)
    assert eng.result(rid).stop_reason == 102 and eng.result(rid).text == "AB"


def test_output_id_beyond_the_tokenizer_vocabulary_decodes_to_nothing():
    eng = engine([150, 101, 199], vocab_size=200)       # tokenizer knows up to 122
    rid = eng.add_request([5], pd.SamplingParams(max_tokens=3))
    run(eng)
    out = eng.result(rid)
    assert out.state == pd.RequestState.FINISHED and out.text == "AB"
    assert out.token_ids == [150, 101, 199]


def test_logit_bias_and_penalties_reach_the_sampler():
    eng = engine([101])
    rid = eng.add_request([5], pd.SamplingParams(max_tokens=3, logit_bias={6: 100.0}))
    plain = eng.add_request([5], pd.SamplingParams(max_tokens=3))
    run(eng)
    assert eng.result(rid).text == "yyy" and eng.result(plain).text == "ABABAB"
    # a frequency penalty larger than the scripted margin (40) pushes the model off 101 after once
    eng = engine([101])
    rid = eng.add_request([5], pd.SamplingParams(max_tokens=3, frequency_penalty=2.0, logit_bias={101: -39.0}))
    run(eng)
    assert eng.result(rid).selected_token_ids[0] == 101 and eng.result(rid).selected_token_ids[1] != 101
