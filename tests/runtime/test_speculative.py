"""Speculative decoding (runtime/spec/speculative.py): the tokens, text, logprobs, endings and usage
of every request are the ones the engine gives without speculation; rejected K/V is never
read; pages, prefix cache, cancel, preemption and the RNG cursor keep their contract."""
import math

import pytest
import torch

import pagedecode as pd
from pagedecode.runtime.spec.speculative import NgramProposer

from .helpers import EOS, engine, of, poison_past_lengths, run

S, R = pd.RequestState, pd.FinishReason
NGRAM = pd.SpeculativeConfig(method="ngram", num_tokens=4, min_ngram=2, max_ngram=4)
CYCLE = [5, 6, 101, 5, 6, 102, 103, 104]        # "xyAB" "xyCD" "EF" "B": bigram "x y" continues two ways
PROMPT = [1] + CYCLE                            # drafts from the first decode step on


def cyclic(prompt, output):
    return CYCLE[len(output) % len(CYCLE)]


# -- configuration and the proposer -----------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [dict(method="eagle"), dict(num_tokens=0), dict(min_ngram=3, max_ngram=2),
                                    dict(min_ngram=0), dict(method="draft"), dict(draft_model="x"),
                                    dict(min_acceptance=1.5), dict(max_batch=0), dict(min_gain=-1),
                                    dict(min_draft_confidence=1.5), dict(min_draft_confidence=-0.1)])
def test_bad_speculative_configs_are_refused(kwargs):
    with pytest.raises(ValueError):
        pd.SpeculativeConfig(**kwargs)
    with pytest.raises(ValueError, match="speculative"):
        pd.EngineConfig(speculative="ngram")


def test_ngram_proposer_longest_suffix_most_recent_match():
    p = NgramProposer(2, 4)
    # suffix "1 2 3" matched (longer than "2 3" which occurs later): continue after it
    assert p.propose([1, 2, 3, 9, 9, 2, 3, 7, 1, 2, 3], 3) == [9, 9, 2]
    assert p.propose([4, 2, 3, 8, 2, 3, 7, 2, 3], 2) == [7, 2]            # most recent "2 3"
    assert p.propose([1, 2, 3, 4], 4) == []                               # nothing repeats
    assert p.propose([1, 2, 1, 2], 4) == [1, 2]                           # at most what follows
    assert NgramProposer(1, 1).propose([7, 5, 7], 2) == [5, 7]
    assert p.propose([5, 6], 3) == []
    # int64 bytes of [256, 0] contain the bytes of token 1 at an odd offset: never a match
    assert NgramProposer(1, 1).propose([256, 0, 5, 9, 1], 2) == []


def test_ngram_proposer_keeps_each_requests_bytes_as_it_grows(stories_engine_factory, grounded_prompt):
    """propose_for (the engine's call) extends its kept bytes by the new output only, and finds
    what propose finds over the whole history at every length."""
    eng = stories_engine_factory()
    rid = eng.add_request(grounded_prompt, pd.SamplingParams(max_tokens=30))
    p, found = NgramProposer(2, 4), 0
    while eng.has_unfinished():
        eng.step()
        req = eng.requests.live.get(rid)
        if req is not None:
            want = p.propose(req.prompt_ids + req.output_ids, 4)
            assert p.propose_for(req, 4) == want
            found += bool(want)
    assert found > 0


# -- exactness with a scripted model: every ending inside a draft run ------------------------------

def normal(events):
    """The events as a client sees them; usage without what speculation adds."""
    out = []
    for e in events:
        if isinstance(e, pd.TerminalEvent):
            u = e.usage
            out.append(("end", e.state, e.finish_reason, e.stop_reason, e.error, u.prompt_tokens,
                        u.selected_tokens, u.returned_tokens, u.returned_bytes))
        elif isinstance(e, pd.DeltaEvent):
            out.append(("delta", e.text, e.token_ids, e.logprobs, e.top_logprobs))
        else:
            out.append(("start",))
    return out


def both(script, prompt, params, **config):
    """Events without and with speculation; the speculative engine's requests."""
    runs = []
    for spec in (None, NGRAM):
        eng = engine(script, speculative=spec, **config)
        rid = eng.add_request(prompt, params, request_id="r")
        runs.append((normal(of(run(eng), rid)), eng))
    (plain, _), (spec, eng) = runs
    assert spec == plain
    return eng


ENDINGS = [
    pd.SamplingParams(max_tokens=40),
    pd.SamplingParams(max_tokens=40, stop_token_ids=[102]),                   # a stop id inside a run
    pd.SamplingParams(max_tokens=40, stop_token_ids=[[6, 102, 103]]),         # a sequence spanning drafts
    pd.SamplingParams(max_tokens=40, stop=["yCDE"]),                          # a stop string held back
    pd.SamplingParams(max_tokens=40, stop=["ABx"], include_stop_str_in_output=True),
    pd.SamplingParams(max_tokens=40, stop=["CDEFB"], logprobs=2),
    pd.SamplingParams(max_tokens=40, temperature=0.9, seed=3, logprobs=1),
]


@pytest.mark.parametrize("params", ENDINGS, ids=range(len(ENDINGS)))
def test_scripted_endings_inside_drafts_equal_plain_decoding(params):
    eng = both(cyclic, PROMPT, params)
    assert eng.result("r").usage.draft_tokens > 0       # it ended in a verify step


def test_eos_and_max_tokens_at_every_position_of_a_run():
    for n in range(1, 26):           # EOS at output n: somewhere in every draft position over the runs
        eos_at = lambda prompt, output, n=n: EOS if len(output) == n - 1 else cyclic(prompt, output)
        both(eos_at, PROMPT, pd.SamplingParams(max_tokens=40))
        both(eos_at, PROMPT, pd.SamplingParams(max_tokens=40, min_tokens=min(n + 2, 40)))   # EOS masked
        both(cyclic, PROMPT, pd.SamplingParams(max_tokens=n))


def test_context_limit_cuts_at_the_same_token():
    for context in range(12, 30):
        eng = both(cyclic, PROMPT, pd.SamplingParams(max_tokens=100), max_context=context)
        assert eng.result("r").finish_reason == R.CONTEXT_LIMIT


# -- exactness on stories260k ----------------------------------------------------------------------

PARAMS = [
    pd.SamplingParams(max_tokens=40),
    pd.SamplingParams(max_tokens=40, temperature=0.8, seed=11),
    pd.SamplingParams(max_tokens=40, temperature=1.0, seed=5, top_k=20, top_p=0.9, min_p=0.05),
    pd.SamplingParams(max_tokens=40, repetition_penalty=1.2, frequency_penalty=0.3, logprobs=3),
    pd.SamplingParams(max_tokens=40, temperature=0.7, seed=2, presence_penalty=0.5, logit_bias={13: 2.0},
                      logprobs=0, stop=[" the park"]),
]


@pytest.fixture(scope="module")
def grounded_prompt(stories_path):
    """A passage the model then reproduces: its own greedy continuation, given back as context."""
    eng = pd.Engine.from_pretrained(stories_path)
    text = eng.generate("Once upon a time", pd.SamplingParams(max_tokens=60))[0].text
    return "Once upon a time" + text + "\nOnce upon a time"


def outputs(eng, prompts, params):
    return [(o.token_ids, o.text, o.logprobs, o.top_logprobs, o.finish_reason, o.selected_token_ids)
            for o in eng.generate(prompts, params)]


def test_stories_greedy_and_seeded_equal_alone_and_batched(stories_engine_factory, grounded_prompt):
    plain, spec = stories_engine_factory(), stories_engine_factory(speculative=NGRAM)
    prompts = ["Once upon a time", grounded_prompt, "Lily and Tom", grounded_prompt, "The cat"]
    assert outputs(spec, prompts, PARAMS) == outputs(plain, prompts, PARAMS)      # one batch, mixed
    for p in PARAMS[:2]:
        assert outputs(spec, [grounded_prompt], p) == outputs(plain, [grounded_prompt], p)   # alone
    snap = spec.snapshot()
    assert snap.spec_decode_num_accepted_tokens > 0.25 * snap.spec_decode_num_draft_tokens > 0


def test_rejected_kv_is_never_read_nan_poison(stories_engine_factory, grounded_prompt):
    """After every step, every cache slot past each request's logical length (rejected drafts'
    K/V among them) and every free page is NaN: a read of any of them would end in NaN logits."""
    params = [pd.SamplingParams(max_tokens=24), pd.SamplingParams(max_tokens=24, temperature=0.8, seed=4)]
    prompts = [grounded_prompt, "Once upon a time"]
    want = outputs(stories_engine_factory(), prompts, params)
    for backend in ("auto", "torch"):
        eng = stories_engine_factory(speculative=NGRAM, enable_prefix_caching=False, attention_backend=backend)
        rids = [eng.add_request(p, q) for p, q in zip(prompts, params)]
        poisoned = 0
        while eng.has_unfinished():
            eng.step()
            poisoned += poison_past_lengths(eng, (eng.kv.k, eng.kv.v))
        got = [eng.result(r) for r in rids]
        assert [(o.token_ids, o.text, o.logprobs, o.top_logprobs, o.finish_reason, o.selected_token_ids)
                for o in got] == want
        assert poisoned > 0 and sum(o.usage.draft_tokens - o.usage.accepted_draft_tokens for o in got) > 0


def test_preemption_recomputes_accepted_tokens_only(stories_engine_factory, grounded_prompt):
    params = [pd.SamplingParams(max_tokens=36, temperature=0.9, seed=s) for s in range(3)] + \
        [pd.SamplingParams(max_tokens=36)]
    prompts = [grounded_prompt, "Once upon a time", "Lily and Tom", grounded_prompt]
    want = outputs(stories_engine_factory(), prompts, params)
    # 30 pages: any one request fits (~27 pages), the first three together outgrow them
    tight = stories_engine_factory(speculative=NGRAM, page_size=4, max_cache_tokens=120, enable_prefix_caching=False)
    got = tight.generate(prompts, params)
    assert tight.snapshot().preemptions > 0 and tight.snapshot().spec_decode_num_accepted_tokens > 0
    assert [(o.token_ids, o.text, o.logprobs, o.top_logprobs, o.finish_reason, o.selected_token_ids)
            for o in got] == want
    tight.check_integrity()
    assert tight.pool.free_pages == tight.pool.num_pages


def test_grammar_output_equal_under_speculation(stories_engine_factory):
    pytest.importorskip("xgrammar")
    so = pd.StructuredOutput(ebnf='root ::= "(" item ("," item){0,6} ")"\nitem ::= "ab" | "abc" | [a-z]{1,3}')
    params = [pd.SamplingParams(max_tokens=60, structured_output=so),
              pd.SamplingParams(max_tokens=60, temperature=1.0, seed=7, structured_output=so)]
    prompts = ["(ab,ab,abc,ab,ab,abc,ab", "(abc,ab,abc,ab,abc"]
    want = outputs(stories_engine_factory(), prompts, params)
    spec = stories_engine_factory(speculative=NGRAM)
    assert outputs(spec, prompts, params) == want
    assert all(w[4] == R.GRAMMAR_COMPLETE for w in want)


def test_drafts_the_grammar_forbids_are_cut_before_verification(stories_engine_factory):
    """The n-gram drafts of "(ab,ab,abc,...": more items than the grammar's seven, and longer
    items than it allows. Each draft run that reaches the forward is one the request's matcher
    accepts token by token (checked, then rolled back, after every extend); the cut ones are
    traced; the outputs stay those of the plain engine."""
    pytest.importorskip("xgrammar")
    so = pd.StructuredOutput(ebnf='root ::= "(" item ("," item){0,6} ")"\nitem ::= "ab" | "abc" | [a-z]{1,3}')
    params = [pd.SamplingParams(max_tokens=60, structured_output=so),
              pd.SamplingParams(max_tokens=60, temperature=1.0, seed=7, structured_output=so)]
    prompts = ["(ab,ab,abc,ab,ab,abc,ab", "(abc,ab,abc,ab,abc"]
    want = outputs(stories_engine_factory(), prompts, params)
    spec = stories_engine_factory(speculative=NGRAM)
    extend, verified = spec.speculator.extend, []

    def checked(plan, scheduler, budget):
        extend(plan, scheduler, budget)
        for s in plan.verify:
            matcher = s.request.grammar.matcher
            taken = 0
            for token in s.drafts:
                assert matcher.accept_token(token), f"draft {s.drafts} reached the forward: {token} forbidden"
                taken += 1
            matcher.rollback(taken)
            verified.append(s.drafts)

    spec.speculator.extend = checked
    rids = [spec.add_request(p, q) for p, q in zip(prompts, params)]
    while spec.has_unfinished():
        spec.step()
    got = [spec.result(r) for r in rids]
    assert [(o.token_ids, o.text, o.logprobs, o.top_logprobs, o.finish_reason, o.selected_token_ids)
            for o in got] == want
    cuts = [r for rid in rids for r in spec.trace(rid) if r["kind"] == "spec.cut"]
    assert verified and cuts and all(r["allowed"] < r["proposed"] for r in cuts)


# -- the step-state contract around a verify step --------------------------------------------------

def test_prefix_cache_registers_only_accepted_tokens():
    eng = engine(cyclic, speculative=NGRAM, page_size=4)
    rid = eng.add_request([1, 5], pd.SamplingParams(max_tokens=30))
    run(eng)
    a = eng.result(rid)
    known = a.prompt_token_ids + a.selected_token_ids
    for page, tokens in eng.pool._tokens.items():
        i = next(i for i in range(len(known) // 4) if tuple(known[4 * i:4 * i + 4]) == tokens)
        assert tokens == tuple(known[4 * i:4 * i + 4])
    # a second request continuing the first reads its pages (the scripted model checks every
    # cached slot holds its token and position on each forward)
    rid2 = eng.add_request(known[:-1], pd.SamplingParams(max_tokens=5))
    run(eng)
    assert eng.result(rid2).usage.cached_tokens >= 24 and eng.result(rid2).state == S.FINISHED


def test_cancel_during_a_verify_step_drops_its_tokens():
    box = {}

    def cancel_in_verify(info):
        batch = info["batch"]
        if any(batch.drafts) and "done" not in box:
            box["done"] = True
            box["before"] = len(eng.requests.live["r"].output_ids)
            assert eng.cancel("r")

    eng = engine(cyclic, speculative=NGRAM, on_forward=cancel_in_verify)
    eng.add_request([1, 5], pd.SamplingParams(max_tokens=60), request_id="r")
    events = run(eng)
    out = eng.result("r")
    assert out.state == S.CANCELLED and len(out.selected_token_ids) == box["before"]
    assert of(events, "r")[-1].state == S.CANCELLED
    assert eng.pool.free_pages == eng.pool.num_pages and eng.slots.free_slots == eng.slots.num_slots
    assert not any(r["kind"] == "token.selected" and r["t"] > box["before"] for r in eng.trace("r"))


def test_cancelling_one_verifying_request_leaves_the_others_rows_alone():
    """Two requests verify drafts in one step and the first is cancelled meanwhile: the second
    still reads its own rows after its drafts (they follow the first's in the batch)."""
    box = {}

    def shifted(prompt, output):             # request "a" (prompt [1, 9, ...]) runs 3 tokens ahead
        return CYCLE[(len(output) + (3 if prompt[1] == 9 else 0)) % len(CYCLE)]

    def cancel_first(info):              # in a step where both verify and b's first two drafts are right
        b = info["batch"]
        if sum(bool(d) for d in b.drafts) != 2 or "done" in box:
            return
        i = b.request_ids.index("b")
        out, drafts = b.output_ids[i], b.drafts[i]
        if len(drafts) >= 2 and all(drafts[j] == shifted(PROMPT, out + list(drafts[:j])) for j in range(2)):
            box["done"] = True
            assert eng.cancel("a")

    plain = engine(shifted)
    plain.add_request(PROMPT, pd.SamplingParams(max_tokens=30), request_id="b")
    want = normal(of(run(plain), "b"))
    eng = engine(shifted, speculative=NGRAM, on_forward=cancel_first)
    eng.add_request([1, 9] + CYCLE[3:] + CYCLE[:3], pd.SamplingParams(max_tokens=30), request_id="a")
    eng.add_request(PROMPT, pd.SamplingParams(max_tokens=30), request_id="b")
    events = run(eng)
    assert box and eng.result("a").state == S.CANCELLED
    assert normal(of(events, "b")) == want and eng.result("b").usage.accepted_draft_tokens > 0


def test_usage_counts_every_kv_position_and_the_drafts():
    written = {}

    def count(info):
        b = info["batch"]
        for rid, a, z in zip(b.request_ids, b.cu_q[:-1].tolist(), b.cu_q[1:].tolist()):
            written[rid] = written.get(rid, 0) + z - a

    eng = engine(cyclic, speculative=NGRAM, on_forward=count)
    rids = [eng.add_request(PROMPT, pd.SamplingParams(max_tokens=n)) for n in (7, 33)]
    run(eng)
    for rid in rids:
        u = eng.result(rid).usage
        assert u.processed_tokens == written[rid]
        assert u.selected_tokens == len(eng.result(rid).selected_token_ids)
        assert 0 < u.draft_tokens and u.accepted_draft_tokens <= u.draft_tokens
    assert eng.result(rids[1]).usage.accepted_draft_tokens > 0
    snap = eng.snapshot()
    assert snap.spec_decode_num_draft_tokens == sum(eng.result(r).usage.draft_tokens for r in rids)
    assert snap.spec_decode_num_accepted_tokens == sum(eng.result(r).usage.accepted_draft_tokens for r in rids)
    verifies = [r for r in eng.trace(rids[1]) if r["kind"] == "spec.verify"]
    assert len(verifies) == snap.spec_decode_num_drafts - sum(
        r["kind"] == "spec.verify" for r in eng.trace(rids[0]))
    assert all(0 <= r["accepted"] <= r["proposed"] for r in verifies)


def test_seeded_request_resumes_at_the_same_rng_cursor():
    """A seeded request draws each output index's noise once: with speculation its tokens are
    those of the plain engine, where drafts were rejected and where they were accepted."""
    params = pd.SamplingParams(max_tokens=40, temperature=6.0, seed=9)   # the script's token ~4 times in 5
    eng = both(cyclic, PROMPT, params)
    assert eng.result("r").usage.accepted_draft_tokens > 0


# -- gates -----------------------------------------------------------------------------------------

def test_batch_gate_turns_proposals_off_for_large_batches():
    eng = engine(cyclic, speculative=pd.SpeculativeConfig(max_batch=2))
    rids = [eng.add_request([1, 5], pd.SamplingParams(max_tokens=30)) for _ in range(3)]
    run(eng)
    assert sum(eng.result(r).usage.draft_tokens for r in rids) == 0
    eng = engine(cyclic, speculative=pd.SpeculativeConfig(max_batch=3))
    rids = [eng.add_request([1, 5], pd.SamplingParams(max_tokens=30)) for _ in range(3)]
    run(eng)
    assert all(eng.result(r).usage.draft_tokens > 0 for r in rids)


def test_acceptance_gate_backs_off_a_request_whose_drafts_fail():
    # "x y" is followed by a new token every time: every draft after it is wrong
    def never_repeats(prompt, output):
        n = len(output)
        return [5, 6][n % 3] if n % 3 < 2 else 120 + n // 3

    def drafts(config):
        eng = engine(never_repeats, speculative=config, vocab_size=400)
        rid = eng.add_request([1], pd.SamplingParams(max_tokens=120))
        run(eng)
        return eng.result(rid).usage
    ungated = drafts(pd.SpeculativeConfig(num_tokens=2, min_acceptance=0.0, min_gain=0.0))
    gated = drafts(pd.SpeculativeConfig(num_tokens=2, min_gain=0.0))        # the acceptance gate alone
    assert ungated.accepted_draft_tokens == gated.accepted_draft_tokens == 0
    assert 0 < gated.draft_tokens < ungated.draft_tokens / 3


@pytest.mark.parametrize("slow", ["verify", "every"])
def test_cost_gate_stops_proposals_where_verify_steps_cost_more_than_they_give(slow):
    """Nearly every draft is accepted (the cyclic script), so only the step-cost gate acts: where a
    verify step takes 20 ms and a plain one none, it turns proposals off after a few steps (it
    measures the plain rate itself, taking a few plain steps); where every step takes 20 ms,
    verifying 5 tokens a step pays and proposals go on."""
    import time

    def delay(info):
        if slow == "every" or any(info["batch"].drafts):
            time.sleep(0.02)

    def drafts(min_gain):
        eng = engine(cyclic, speculative=pd.SpeculativeConfig(min_gain=min_gain), on_forward=delay)
        rid = eng.add_request(PROMPT, pd.SamplingParams(max_tokens=300))
        run(eng)
        return eng.result(rid).usage
    ungated, gated = drafts(0.0), drafts(0.97)
    assert ungated.accepted_draft_tokens > 0.8 * ungated.draft_tokens > 150
    if slow == "verify":
        assert 0 < gated.draft_tokens < ungated.draft_tokens / 2
    else:
        assert gated.draft_tokens > 0.8 * ungated.draft_tokens


# -- the draft-model proposer ----------------------------------------------------------------------

def test_draft_model_scripted_outputs_equal_and_its_cache_rolls_back():
    """The target follows CYCLE; the draft agrees except at every 5th output position. The
    scripted draft checks on every forward that its pages hold each earlier token at its
    position (so its catch-up after accepted and rejected drafts is right). The seeded request
    asks for logprobs, which keeps it on the exact-match path (sampling requests without them
    take the rejection rule: test_spec_rejection.py)."""
    from pagedecode.testing import ScriptedModel

    def wrong_at_fifths(prompt, output):
        return 103 if len(output) % 5 == 4 else cyclic(prompt, output)

    draft = ScriptedModel(wrong_at_fifths, vocab_size=200, eos_token_ids=[EOS])
    config = pd.SpeculativeConfig(method="draft", draft_model=draft, num_tokens=3, min_acceptance=0.0, min_gain=0.0)
    params = [pd.SamplingParams(max_tokens=37), pd.SamplingParams(max_tokens=23, stop=["yCDE"]),
              pd.SamplingParams(max_tokens=30, temperature=6.0, seed=4, logprobs=0)]
    got, want = [], []
    for spec, out in ((None, want), (config, got)):
        eng = engine(cyclic, speculative=spec)
        rids = [eng.add_request(PROMPT, p) for p in params]
        events = run(eng)
        out.extend(normal(of(events, r)) for r in rids)
    assert got == want
    usage = [eng.result(r).usage for r in rids]
    assert all(u.accepted_draft_tokens > 0 for u in usage[::2])
    assert draft.forward_calls > 0
    eng.add_request(PROMPT, pd.SamplingParams(max_tokens=9), request_id="last")
    run(eng)
    proposer = eng.speculator.draft
    assert set(r.request_id for r in proposer._seqs) <= {"last"}      # the others gave their pages back
    assert proposer.pool.free_pages == proposer.pool.num_pages - sum(len(s.pages) for s in proposer._seqs.values())


def test_draft_model_stories_as_its_own_draft(stories_engine_factory, stories_path):
    """Greedy: the plain engine's tokens. Sampling (the rejection rule): the draft's q is the
    target's p up to rounding, so nearly every draft is kept, and the text is the model's."""
    params = [pd.SamplingParams(max_tokens=24), pd.SamplingParams(max_tokens=24, temperature=0.8, seed=3)]
    prompts = ["Once upon a time", "Lily and Tom"]
    want = outputs(stories_engine_factory(), prompts, params)
    spec = stories_engine_factory(speculative=pd.SpeculativeConfig(method="draft", draft_model=str(stories_path),
                                                                   min_gain=0.0))
    outs = spec.generate(prompts, params)
    got = [(o.token_ids, o.text, o.logprobs, o.top_logprobs, o.finish_reason, o.selected_token_ids) for o in outs]
    assert got[0] == want[0]
    assert len(got[1][0]) == 24 and got[1][4] == R.MAX_OUTPUT_TOKENS
    usage = [o.usage for o in outs]
    assert all(u.draft_tokens > 0 for u in usage)
    assert usage[1].accepted_draft_tokens > 0.9 * usage[1].draft_tokens


def test_deterministic_mode_logprobs_bitwise_equal(stories_engine_factory, grounded_prompt):
    params = [pd.SamplingParams(max_tokens=32, logprobs=2),
              pd.SamplingParams(max_tokens=32, temperature=0.9, seed=8, logprobs=0)]
    prompts = [grounded_prompt, grounded_prompt]
    want = outputs(stories_engine_factory(deterministic=True), prompts, params)
    spec = stories_engine_factory(deterministic=True, speculative=NGRAM)
    got = outputs(spec, prompts, params)
    assert got == want          # logprobs and top logprobs compared as floats: the same bits
    assert spec.snapshot().spec_decode_num_accepted_tokens > 0


def test_a_float32_draft_narrows_its_cache_with_the_target(stories_path):
    """kv_cache_dtype: the draft's cache holds as many tokens as the target's, in the same dtype
    (a float32 draft narrows with it, so a float16 target cache does not leave the draft's at twice
    its bytes); the tokens are the same as on float32 caches."""
    spec = pd.SpeculativeConfig(method="draft", draft_model=str(stories_path), num_tokens=3)
    outs, drafts = {}, {}
    for kv in ("auto", "float16"):
        engine = pd.Engine.from_pretrained(stories_path, kv_cache_dtype=kv, speculative=spec,
                                           memory_budget_bytes=1 << 20)
        draft_kv = engine.speculator.draft.kv
        drafts[kv] = draft_kv.k.dtype, draft_kv.k.nbytes, engine.kv.k.nbytes
        outs[kv] = [o.token_ids for o in engine.generate(["Once upon a time", "The cat"],
                                                          pd.SamplingParams(max_tokens=24))]
        engine.close()
    assert drafts["auto"][0] == torch.float32 and drafts["float16"][0] == torch.float16
    assert drafts["float16"][1] == drafts["float16"][2] == drafts["auto"][1] == drafts["auto"][2]
    assert outs["float16"] == outs["auto"]
