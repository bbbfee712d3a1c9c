"""The draft model's own cache (runtime/spec/draft_model.py): the K/V it wrote for its drafts is
kept where the target accepted them, so a proposal after a run recomputes one or two rows, not
the whole run; the scripted draft checks on every forward that its cache holds the tokens it
should (a reused row that were not the request's token would fail it, and speculation with it)."""
import math
import time

import pytest
import torch

import pagedecode as pd
from pagedecode.testing import ScriptedModel

from .helpers import EOS, engine, poison_past_lengths, run

CYCLE = [5, 6, 101, 102, 103]


def cycle(prompt, output):
    """The next token of a fixed cycle after the last known token."""
    last = (prompt + output)[-1]
    return CYCLE[(CYCLE.index(last) + 1) % len(CYCLE)] if last in CYCLE else CYCLE[0]


def wrong_every_fourth(prompt, output):
    """The cycle, except at every fourth output position (then a token the target never picks)."""
    return 104 if len(output) % 4 == 3 else cycle(prompt, output)


@pytest.mark.parametrize("draft_script, most_rows", [(cycle, 2), (wrong_every_fourth, 2)])
def test_a_proposal_recomputes_only_what_its_drafts_did_not_write(draft_script, most_rows):
    """k = 3: a run kept whole leaves d1 d2 in the draft's cache, so the next proposal computes
    d3 and the token after it (2 rows; it computed 4 before); a run cut short leaves the kept
    drafts and computes the token after them (1 row). The output is the plain engine's."""
    calls = []                             # rows of each draft forward, None where a proposal starts
    draft = ScriptedModel(draft_script, vocab_size=200, eos_token_ids=[EOS],
                          on_forward=lambda info: calls.append(info["batch"].input_ids.numel()))
    config = pd.SpeculativeConfig(method="draft", draft_model=draft, num_tokens=3, min_acceptance=0.0, min_gain=0.0)
    params = pd.SamplingParams(max_tokens=40)
    want = engine(cycle).generate([[1, 5]], params)[0].token_ids
    eng = engine(cycle, speculative=config)
    proposer = eng.speculator.draft
    propose = proposer.propose
    proposer.propose = lambda wants: calls.append(None) or propose(wants)
    rid = eng.add_request([1, 5], params)
    run(eng)
    got = eng.result(rid)
    first_rows = [calls[i + 1] for i, c in enumerate(calls) if c is None]
    assert got.token_ids == want
    assert got.usage.accepted_draft_tokens > 10                  # the draft's cache checks passed: it drafted
    assert first_rows[0] == 3 and max(first_rows[1:]) <= most_rows   # prompt and y1, then one or two rows
    assert len(first_rows) > 8


def unsure(prompt, output):
    """The cycle's next token at probability 0.7 (the rest spread over four others)."""
    row = torch.full((200,), float("-inf"))
    row[[5, 6, 101, 102, 103]] = math.log(0.075)
    row[cycle(prompt, output)] = math.log(0.7)
    return row


@pytest.mark.parametrize("min_confidence, longest", [(0.0, 4), (0.5, 2), (0.75, 1)])
def test_a_run_stops_drafting_where_the_draft_is_unsure_of_it(min_confidence, longest):
    """Each draft token at probability 0.7 under the draft: a run of k = 4 stops after 2 at 0.5
    (0.7 * 0.7 < 0.5), after 1 at 0.75; the tokens stay the plain engine's."""
    draft = ScriptedModel(unsure, vocab_size=200, eos_token_ids=[EOS])
    config = pd.SpeculativeConfig(method="draft", draft_model=draft, num_tokens=4, min_acceptance=0.0, min_gain=0.0,
                                  min_draft_confidence=min_confidence)
    params = pd.SamplingParams(max_tokens=30)
    eng = engine(cycle, speculative=config)
    rid = eng.add_request([1, 5], params)
    run(eng)
    runs = [r["proposed"] for r in eng.trace(rid) if r["kind"] == "spec.verify"]
    assert eng.result(rid).token_ids == engine(cycle).generate([[1, 5]], params)[0].token_ids
    assert max(runs) == longest and runs.count(longest) >= 5


def test_the_cost_gate_counts_drafting_in_the_step_that_drafts():
    """A draft whose every token is right but whose forward takes 50 ms: 4 draft forwards make a
    step of 5 tokens 200 ms, far slower than the plain steps' one token each. The step-cost gate
    turns drafting off at this batch size; it did not while a step was timed from the end of its
    drafting, which charged the drafting to the step before (the gate's plain samples were
    mostly steps before a drafting one, and looked as slow)."""
    draft = ScriptedModel(cycle, vocab_size=200, eos_token_ids=[EOS], on_forward=lambda info: time.sleep(0.05))
    config = pd.SpeculativeConfig(method="draft", draft_model=draft, num_tokens=4, min_acceptance=0.0)
    eng = engine(cycle, speculative=config)
    rid = eng.add_request([1, 5], pd.SamplingParams(max_tokens=300))
    run(eng)
    got = eng.result(rid)
    assert got.usage.accepted_draft_tokens == got.usage.draft_tokens > 0    # right, and too slow to pay
    assert eng.speculator.counters.drafts < 30, eng.speculator.counters


def test_a_self_draft_drafts_on_the_target_cache_one_row_a_sequence(stories_engine_factory):
    """The quantized self-draft reads and writes the target's own cache: each draft forward is
    one row per drafting sequence (no prompt prefill in the draft, no catch-up after a rejection);
    and with every slot past each request's logical length and every free page poisoned with
    NaN after every step, the tokens are still the plain engine's (its context is the target's
    accepted K/V; what it writes past the length is overwritten by the verify before any read)."""
    prompts = ["Once upon a time", "Lily and Tom"]
    params = pd.SamplingParams(max_tokens=32)
    want = [o.token_ids for o in stories_engine_factory().generate(prompts, params)]
    spec = pd.SpeculativeConfig(method="draft", draft_quantization="q4_0", min_gain=0.0, min_acceptance=0.0)
    eng = stories_engine_factory(speculative=spec, enable_prefix_caching=False)
    draft = eng.speculator.draft
    assert draft is not None and draft.kv is eng.kv
    shapes = []                                    # (rows, sequences) of each draft forward
    forward = draft.model.forward
    draft.model.forward = lambda b, kv: shapes.append((b.input_ids.numel(), b.seq_lens.numel())) or forward(b, kv)
    rids = [eng.add_request(p, params) for p in prompts]
    while eng.has_unfinished():
        eng.step()
        poison_past_lengths(eng, (eng.kv.k, eng.kv.v))
    got = [eng.result(r) for r in rids]
    assert [o.token_ids for o in got] == want
    assert shapes and all(rows == seqs for rows, seqs in shapes)
    assert sum(o.usage.accepted_draft_tokens for o in got) > 0
    assert sum(o.usage.draft_tokens - o.usage.accepted_draft_tokens for o in got) > 0     # rejections too


def test_a_bfloat16_targets_self_draft_computes_in_float32_on_its_cache(stories_engine_factory):
    """On CPU the quantized self-draft of a bfloat16 target is a float32 model (faster there) on
    the target's bfloat16 cache; the tokens stay the plain bfloat16 engine's."""
    prompts = ["Once upon a time", "Lily and Tom"]
    params = pd.SamplingParams(max_tokens=24)
    want = [o.token_ids for o in stories_engine_factory(dtype=torch.bfloat16).generate(prompts, params)]
    spec = pd.SpeculativeConfig(method="draft", draft_quantization="q8_0", min_gain=0.0, min_acceptance=0.0)
    eng = stories_engine_factory(dtype=torch.bfloat16, speculative=spec)
    draft = eng.speculator.draft
    assert draft is not None and draft.model.dtype == torch.float32
    assert draft.kv is eng.kv and eng.kv.k.dtype == torch.bfloat16
    got = eng.generate(prompts, params)
    assert [o.token_ids for o in got] == want
    assert sum(o.usage.accepted_draft_tokens for o in got) > 0


# -- prompt lookup backing a draft model: turned back on by what it would have proposed ------------

COPIED = list(range(20, 60))                     # the prompt's passage, 40 distinct tokens
# the output: false starts that lookup drafts wrongly twice (its gate goes off: "20 21" was
# followed by 95 before, "22 23" by 24 in the prompt), then the passage copied from its 11th token
REWRITE_THEN_COPY = [20, 21, 95, 20, 21, 96, 22, 23, 97] + COPIED[10:] + [EOS]


def lookup_backing_a_slow_draft(monkeypatch, followed):
    """The scripted run: a draft model that is always right but drafts one token a run, backed by
    prompt lookup; `followed`: shadow tokens the output must follow to reopen lookup's gate."""
    monkeypatch.setattr("pagedecode.runtime.spec.speculative.SHADOW_FOLLOWED", followed)
    draft = ScriptedModel(REWRITE_THEN_COPY, vocab_size=200, eos_token_ids=[EOS])
    config = pd.SpeculativeConfig(method="draft", draft_model=draft, prompt_lookup=True, num_tokens=1, min_gain=0.0)
    eng = engine(REWRITE_THEN_COPY, speculative=config)
    rid = eng.add_request([1] + COPIED, pd.SamplingParams(max_tokens=60))
    run(eng)
    return eng, rid


def test_prompt_lookup_turned_off_comes_back_where_the_output_follows_it(monkeypatch):
    """Lookup's gate goes off after two misses (a back-off of 8 steps). While it is off, what lookup
    would have proposed is kept; once the output has followed two tokens of it, the gate is on
    again (at 4 drafts, twice what was followed) and the copy drafts from lookup. Without that, the
    back-off was waited out at one token a run from the draft, and lookup's runs earned their
    length back from one. The tokens are the plain engine's either way."""
    from pagedecode.runtime.spec.gates import SHADOW_FOLLOWED
    want = engine(REWRITE_THEN_COPY).generate([[1] + COPIED], pd.SamplingParams(max_tokens=60))[0].token_ids
    assert want == REWRITE_THEN_COPY[:-1]
    runs = {}
    for name, followed in (("reopened", SHADOW_FOLLOWED), ("waited", 10_000)):
        eng, rid = lookup_backing_a_slow_draft(monkeypatch, followed)
        assert eng.result(rid).token_ids == want
        kinds = [r["kind"] for r in eng.trace(rid)]
        assert kinds.count("spec.gated") == 1                 # the false starts turned lookup off
        runs[name] = (eng.steps, eng.speculator.counters.lookup_tokens, kinds)
    steps, lookups, kinds = runs["reopened"]
    assert kinds.count("spec.lookup_reopened") == 1 and kinds.index("spec.lookup_reopened") > kinds.index("spec.gated")
    assert "spec.lookup_reopened" not in runs["waited"][2]
    assert steps < runs["waited"][0] and lookups > runs["waited"][1]


def draft_wrong_at_every_third(prompt, output):
    """REWRITE_THEN_COPY's next token, except in the copy at output positions 9, 12, 15, ... (a
    token the target never picks): with one draft a run, its steps make 1 and 2 tokens in turn."""
    n = len(output)
    return 199 if n >= 9 and n % 3 == 0 else REWRITE_THEN_COPY[min(n, len(REWRITE_THEN_COPY) - 1)]


def test_what_lookup_would_have_proposed_is_followed_over_several_steps(monkeypatch):
    """The output follows a kept lookup proposal 1 and 2 tokens a step in turn; with 3 tokens asked
    to reopen lookup's gate, it reopens once they are followed, over two steps. (The proposal was
    taken anew every step, so only one step's tokens counted, and 3 were never reached.) The
    step-cost gate's plain measuring steps are kept out: they would skip the steps this is about."""
    monkeypatch.setattr("pagedecode.runtime.spec.speculative.SHADOW_FOLLOWED", 3)
    monkeypatch.setattr("pagedecode.runtime.spec.gates.CostGate.WARMUP", 10_000)
    want = engine(REWRITE_THEN_COPY).generate([[1] + COPIED], pd.SamplingParams(max_tokens=60))[0].token_ids
    draft = ScriptedModel(draft_wrong_at_every_third, vocab_size=200, eos_token_ids=[EOS])
    config = pd.SpeculativeConfig(method="draft", draft_model=draft, prompt_lookup=True, num_tokens=1, min_gain=0.0)
    eng = engine(REWRITE_THEN_COPY, speculative=config)
    rid = eng.add_request([1] + COPIED, pd.SamplingParams(max_tokens=60))
    run(eng)
    assert eng.result(rid).token_ids == want
    records = eng.trace(rid)
    kinds = [r["kind"] for r in records]
    assert kinds.count("spec.gated") >= 1
    reopened = [r for r in records if r["kind"] == "spec.lookup_reopened"]
    assert reopened and reopened[0]["followed"] >= 3
    assert kinds.index("spec.lookup_reopened") > kinds.index("spec.gated")


def test_a_lookup_proposal_too_short_to_reopen_its_gate_is_not_kept():
    """While prompt lookup's gate is off, what it would propose is kept to judge the output by; one
    token after "7 7 7" (the match is the run itself) is fewer than SHADOW_FOLLOWED and could never
    reopen the gate. Kept, it stayed at its first position for the rest of the off period once the
    output followed it to its end; it is not kept, and a long enough proposal still is."""
    from pagedecode.runtime.request import Request
    from pagedecode.runtime.spec.gates import SHADOW_FOLLOWED
    from pagedecode.runtime.trace import Trace

    draft = ScriptedModel(cycle, vocab_size=200, eos_token_ids=[EOS])
    eng = engine(cycle, speculative=pd.SpeculativeConfig(method="draft", draft_model=draft, prompt_lookup=True))
    spec = eng.speculator

    def gated(prompt: list[int]) -> Request:
        req = Request("r", prompt, pd.SamplingParams(max_tokens=20), seed=0, arrival=0.0, pipeline=None,
                      trace=Trace("r"))
        spec._gate(req, own=True).off_until = spec._step + 100
        return req

    short = gated([1, 7, 7, 7])
    assert spec.ngram.propose_for(short, 8) == [7] and SHADOW_FOLLOWED > 1
    spec._lookup(short, 4)
    assert short not in spec._shadows
    long = gated([1, 2, 3, 4, 5, 9, 1, 2])
    spec._lookup(long, 4)
    assert spec._shadows[long] == (0, [3, 4, 5, 9, 1, 2])
