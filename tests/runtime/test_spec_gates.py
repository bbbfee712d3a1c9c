"""The acceptance gate under hostile sampling (issue 34, items 8 and 9): a request earns its draft
length, a failing one backs off with one short probe per retry, so a repetitive prompt sampled at
temperature 1.5 verifies a handful of rows, not k per step; speculation never changes a token,
and its logprobs are the plain engine's within a stated tolerance (bitwise with deterministic)."""
import pytest
import torch

import pagedecode as pd
from pagedecode.model.default_model import default_model_path
from pagedecode.runtime.spec.gates import FIRST_DRAFT, Gate

REPETITIVE = "the cat sat on the mat. " * 20
HOT = pd.SamplingParams(max_tokens=256, temperature=1.5, seed=1, ignore_eos=True)
# speculation's logprobs in the default mode: float32 rounding of the verify rows' logits
LOGPROB_TOLERANCE = 1e-4


def test_a_request_earns_its_draft_length():
    gate = Gate(most=64, backoff=8)
    assert gate.length == FIRST_DRAFT
    for expected in (4, 8, 16, 32, 64, 64):
        assert not gate.record(gate.length, gate.length, 0, 0.3, 8)     # kept whole: doubles up to k
        assert gate.length == expected
    assert not gate.record(3, 64, 1, 0.3, 8) and gate.length == 4        # a miss: one past what was kept


def test_a_draft_that_sizes_its_own_runs_keeps_its_length_after_a_miss():
    """earns=False (a draft model with min_draft_confidence, which stops where it is unsure): a
    miss leaves the next run's length at k (the gate fell to 2 there, and a confident draft's runs
    never grew back long enough to pay), while a low acceptance still turns proposals off; its
    short runs weigh in the rolling rate by their drafts (four one-draft misses do not turn it off)."""
    gate = Gate(most=6, backoff=8, length=6, earns=False)
    assert not gate.record(1, 6, 0, 0.3, 8) and gate.length == 6
    assert gate.record(0, 6, 1, 0.3, 8) and gate.off_until == 9 and gate.length == 6
    short = Gate(most=6, backoff=8, length=6, earns=False)     # a run weighs by its drafts
    assert not any(short.record(0, 1, step, 0.3, 8) for step in range(4)) and short.rate > 0.7
    earning = Gate(most=6, backoff=8, length=6)
    assert not earning.record(1, 6, 0, 0.3, 8) and earning.length == 2


def test_a_failing_request_backs_off_and_each_retry_is_one_probe():
    gate = Gate(most=64, backoff=8)
    step, offs = 0, []
    while len(offs) < 4:
        step = max(step + 1, gate.off_until)
        if gate.record(0, gate.length, step, 0.3, 8):
            offs.append(gate.off_until - step)
    assert offs == [8, 16, 32, 64] and gate.length == 1                  # after the first, a probe each


def test_min_acceptance_zero_proposes_k_every_run():
    gate = Gate(most=5, backoff=8, length=5)
    assert not gate.record(0, 5, 1, 0.0, 8) and gate.length == 5 and gate.off_until == 0


@pytest.fixture(scope="module")
def default_model():
    """The default model, on one thread (a tiny model: torch's threads only contend on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield default_model_path()
    torch.set_num_threads(threads)


@pytest.mark.parametrize("k", [4, 64])
def test_hot_sampling_over_a_repetitive_prompt_turns_drafting_off(default_model, k):
    """Ungated every match proposes k rows, none kept (43 rows at k = 4, 355 at k = 64; the gate
    before this one let 24 and 214 through). Gated: a first run of FIRST_DRAFT rows, then probes
    of one row, each turning the request off again for twice as long."""
    plain = pd.Engine.from_pretrained(default_model)
    want = plain.generate([REPETITIVE], HOT)[0]
    drafted = {}
    for name, config in (("ungated", pd.SpeculativeConfig(num_tokens=k, min_acceptance=0.0, min_gain=0.0)),
                         ("gated", pd.SpeculativeConfig(num_tokens=k))):
        spec = pd.Engine.from_pretrained(default_model, speculative=config)
        rid = spec.add_request(REPETITIVE, HOT)
        lengths = []
        while spec.has_unfinished():
            spec.step()
            lengths += [gate.length for gate in spec.speculator._gates.values()]
        got = spec.result(rid)
        assert got.token_ids == want.token_ids                 # speculation never changes a token
        assert got.usage.accepted_draft_tokens == 0
        drafted[name] = (got.usage.draft_tokens, spec.speculator.counters.gated, lengths[-1])
    (ungated, _, _), (gated, turned_off, length) = drafted["ungated"], drafted["gated"]
    assert ungated >= 5 * gated and gated <= 8, drafted                   # 43 / 355 ungated, 6 gated
    assert turned_off >= 3 and length == 1, drafted                        # the gate's decisions


@pytest.mark.parametrize("deterministic", [False, True])
def test_speculation_keeps_tokens_and_logprobs_within_the_stated_tolerance(default_model, deterministic):
    """What holds (the README's statement): tokens equal always; with deterministic=True
    logprobs and top logprobs bitwise equal; otherwise within LOGPROB_TOLERANCE (float32: the
    verify rows are computed k + 1 positions at a time, summed in another order than a decode
    row; measured up to 4.5e-6 on this model)."""
    options = {"deterministic": deterministic}
    plain = pd.Engine.from_pretrained(default_model, **options)
    spec = pd.Engine.from_pretrained(default_model, speculative=pd.SpeculativeConfig(min_acceptance=0.0, min_gain=0.0),
                                     **options)
    params = [pd.SamplingParams(max_tokens=120, logprobs=2, ignore_eos=True),
              pd.SamplingParams(max_tokens=120, temperature=0.8, seed=3, logprobs=2, ignore_eos=True)]
    prompts = ["the cat sat on the mat. " * 8] * 2
    want, got = plain.generate(prompts, params), spec.generate(prompts, params)
    assert sum(o.usage.accepted_draft_tokens for o in got) > 50              # the verify rows were read
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids and a.text == b.text and a.finish_reason == b.finish_reason
        if deterministic:
            assert a.logprobs == b.logprobs and a.top_logprobs == b.top_logprobs
            continue
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= LOGPROB_TOLERANCE
        for top_a, top_b in zip(a.top_logprobs, b.top_logprobs):
            assert [t for t, _ in top_a] == [t for t, _ in top_b] or _tied(top_a)
            assert max(abs(x - y) for (_, x), (_, y) in zip(sorted(top_a), sorted(top_b))) <= LOGPROB_TOLERANCE


def _tied(top):
    """Two alternatives within the tolerance may trade places."""
    values = sorted(v for _, v in top)
    return any(b - a <= LOGPROB_TOLERANCE for a, b in zip(values, values[1:]))
