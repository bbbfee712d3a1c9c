"""The draft model's rejection rule in the engine (runtime/spec/rejection.py): a sampling request
under method="draft" gets the target's distribution whatever the draft's, accepts more drafts
than exact matching would, stays reproducible by its seed, ends exactly where the plain engine
would on the same tokens; the requests it does not cover keep the exact-match path."""
import dataclasses
import random
import zlib

import pytest
import torch

import pagedecode as pd
from pagedecode.runtime.intake import make_request
from pagedecode.runtime.spec.rejection import takes_rejection
from pagedecode.testing import ScriptedModel
from tests.kernels.test_rejection import chi_square_pvalue

from .helpers import EOS, engine, of, run, tokenizer
from .test_speculative import normal

R = pd.FinishReason
V = 200
STATES = [5, 6, 101, 102]                      # "x" "y" "AB" "CD": the chains below move among them
TARGET = torch.tensor([[0.10, 0.50, 0.30, 0.10],    # from 5
                       [0.40, 0.10, 0.10, 0.40],    # from 6
                       [0.25, 0.25, 0.25, 0.25],    # from 101
                       [0.60, 0.20, 0.10, 0.10]])   # from 102
DRAFT = torch.tensor([[0.70, 0.10, 0.10, 0.10],     # wrong most of the time: its favourite is one
                      [0.10, 0.70, 0.10, 0.10],     # the target rarely picks
                      [0.10, 0.10, 0.10, 0.70],
                      [0.10, 0.10, 0.70, 0.10]])


def chain(table):
    """A scripted model whose next token follows `table` from the last known token."""
    def logits(prompt, output):
        last = (prompt + output)[-1]
        row = torch.full((V,), float("-inf"))
        row[STATES] = table[STATES.index(last)].log()
        return row
    return logits


def draft_config(draft_script, **kwargs):
    draft = ScriptedModel(draft_script, vocab_size=V, eos_token_ids=[EOS])
    kwargs = dict(num_tokens=3, min_acceptance=0.0, min_gain=0.0, max_batch=256) | kwargs
    return pd.SpeculativeConfig(method="draft", draft_model=draft, **kwargs)


def seeded(n, **params):
    return [pd.SamplingParams(seed=zlib.crc32(f"rejection-{i}".encode()), **params) for i in range(n)]


def pair_counts(outputs, n):
    """Counts of (y_{n-1}, y_n) over the outputs, 16 cells in STATES order (n is 1-based)."""
    seen = torch.zeros(len(STATES), len(STATES))
    for o in outputs:
        seen[STATES.index(o.token_ids[n - 2]), STATES.index(o.token_ids[n - 1])] += 1
    return seen.flatten()


def pair_probs(n):
    """P(y_{n-1}, y_n) of the target chain from prompt [1, 5]."""
    marginal = TARGET[0]                                # y1
    for _ in range(n - 2):
        marginal = marginal @ TARGET
    return (marginal[:, None] * TARGET).flatten()


def test_output_follows_the_target_and_accepts_more_than_exact_matching():
    """Many seeded requests at temperature 1: the pairs of tokens at positions (2, 3) and (4, 5),
    both chosen by verify runs, follow the target chain (chi-square, p = 0.001), under the
    rejection rule and under exact matching (logprobs asked: the exact path), and the rule keeps
    far more of the same draft's tokens: sum_x min(p, q) against p(argmax q) per position."""
    n, steps = 600, 5
    rates = {}
    for rule, extra in (("rejection", {}), ("match", {"logprobs": 0})):
        eng = engine(chain(TARGET), speculative=draft_config(chain(DRAFT)), max_batch_size=128,
                     max_tokens_per_step=1024, trace="lifecycle")
        outputs = eng.generate([[1, 5]] * n, seeded(n, max_tokens=steps, temperature=1.0, **extra))
        assert all(len(o.token_ids) == steps for o in outputs)
        for pos in (3, 5):
            p_value = chi_square_pvalue(pair_counts(outputs, pos), pair_probs(pos))
            assert p_value > 0.001, (rule, pos, p_value)
        snap = eng.snapshot()
        assert snap.spec_decode_num_draft_tokens > n          # verify runs chose these positions
        rates[rule] = snap.spec_decode_num_accepted_tokens / snap.spec_decode_num_draft_tokens
    print(f"acceptance: rejection rule {rates['rejection']:.3f}, exact match {rates['match']:.3f}")
    # per position the rule keeps a draft with probability sum_x min(p, q): 0.40 / 0.40 / 0.55 / 0.40
    # from each state, exact matching with p(argmax q): 0.10 / 0.10 / 0.25 / 0.10; of k = 3 drafts,
    # (a + a^2 + a^3) / 3 are kept at a rate a: about 0.25 against 0.05
    assert 0.18 < rates["rejection"] < 0.35 and 0.02 < rates["match"] < 0.1
    assert rates["rejection"] > 3 * rates["match"]


def test_a_seeded_request_gives_the_same_tokens_alone_and_in_a_batch():
    mine = pd.SamplingParams(max_tokens=30, temperature=1.0, seed=77)
    others = seeded(6, max_tokens=25, temperature=0.7) + [pd.SamplingParams(max_tokens=20),
                                                          pd.SamplingParams(max_tokens=20, temperature=1.0, seed=3,
                                                                            logprobs=1)]
    got = []
    for batch in ([mine], others[:3] + [mine] + others[3:]):
        eng = engine(chain(TARGET), speculative=draft_config(chain(DRAFT)))
        rids = [eng.add_request([1, 5], p) for p in batch]
        run(eng)
        rid = rids[batch.index(mine)]
        got.append(eng.result(rid).token_ids)
        verifies = [r for r in eng.trace(rid) if r["kind"] == "spec.verify"]
        assert verifies and all(r["rule"] == "rejection" for r in verifies)
        assert eng.result(rid).usage.accepted_draft_tokens > 0
    assert got[0] == got[1]
    # another seed draws other tokens (the seed is what keys them)
    eng = engine(chain(TARGET), speculative=draft_config(chain(DRAFT)))
    assert eng.generate([[1, 5]], dataclasses.replace(mine, seed=78))[0].token_ids != got[0]


def test_a_deterministic_engine_keeps_exact_matching_for_sampled_requests():
    """Deterministic mode promises a seeded request the same tokens whatever else runs; the rule's
    tokens depend on the verify schedule, so there every request is verified by exact matching:
    the plain deterministic engine's tokens, token for token, alone or in a batch."""
    def make(**config):
        model = ScriptedModel(chain(TARGET), vocab_size=V, eos_token_ids=[EOS])
        model.deterministic = False                 # a script is batch-invariant as it is
        return pd.Engine(model, tokenizer(), pd.EngineConfig(max_cache_tokens=4096, trace="tokens",
                                                             deterministic=True, **config))
    params = seeded(8, max_tokens=30, temperature=1.0)
    want = [o.token_ids for o in make().generate([[1, 5]] * len(params), params)]
    eng = make(speculative=draft_config(chain(DRAFT)))
    rids = [eng.add_request([1, 5], p) for p in params]
    run(eng)
    assert [eng.result(r).token_ids for r in rids] == want
    verifies = [t for r in rids for t in eng.trace(r) if t["kind"] == "spec.verify"]
    assert verifies and all(t["rule"] == "match" for t in verifies)
    assert sum(eng.result(r).usage.accepted_draft_tokens for r in rids) > 0


# a target that mostly follows a cycle (EOS possible), and a flatter draft, often wrong
CYCLE = [5, 6, 101, 5, 6, 102, 103, 104]
SUPPORT = [5, 6, 101, 102, 103, 104, EOS]


def noisy_cycle(peak):
    def logits(prompt, output):
        row = torch.full((V,), float("-inf"))
        row[SUPPORT] = 0.0
        row[CYCLE[len(output) % len(CYCLE)]] = peak
        return row
    return logits


ENDINGS = [            # each with the ending most of its requests meet
    (pd.SamplingParams(max_tokens=40), R.EOS),
    (pd.SamplingParams(max_tokens=7), R.MAX_OUTPUT_TOKENS),
    (pd.SamplingParams(max_tokens=40, stop_token_ids=[102]), R.STOP_SEQUENCE),           # a stop id
    (pd.SamplingParams(max_tokens=40, stop_token_ids=[[6, 102, 103]]), R.STOP_SEQUENCE),  # spanning drafts
    (pd.SamplingParams(max_tokens=40, stop=["yCDE"]), R.STOP_SEQUENCE),                  # held back
    (pd.SamplingParams(max_tokens=40, stop=["ABx"], include_stop_str_in_output=True), R.STOP_SEQUENCE),
    (pd.SamplingParams(max_tokens=40, stop=["CDEFB"], ignore_eos=True), R.STOP_SEQUENCE),
]


def replay(tokens):
    """A scripted target that emits exactly `tokens` (then anything)."""
    return lambda prompt, output: tokens[len(output)] if len(output) < len(tokens) else 5


def ended_on_a_kept_draft(trace):
    """The request's last token was a kept draft of its last verify run (the ending cut the run)."""
    last = max((i for i, r in enumerate(trace) if r["kind"] == "spec.verify"), default=None)
    if last is None:
        return False
    taken = sum(r["kind"] == "token.selected" for r in trace[last:])
    return taken <= trace[last]["accepted"]


@pytest.mark.parametrize("params,reason", ENDINGS, ids=range(len(ENDINGS)))
def test_endings_inside_accepted_runs_cut_where_the_plain_engine_does(params, reason):
    """Whatever tokens the rule chose, the plain engine given those tokens (greedy replay) ends at
    the same one with the same events, text and usage: nothing after an ending is emitted."""
    batch = [dataclasses.replace(params, temperature=1.0, seed=s) for s in range(12)]
    eng = engine(noisy_cycle(3.0), speculative=draft_config(noisy_cycle(1.0)))
    rids = [eng.add_request([1, 5], p) for p in batch]
    events = run(eng)
    accepted = 0
    for rid, p in zip(rids, batch):
        out = eng.result(rid)
        accepted += out.usage.accepted_draft_tokens
        plain = engine(replay(out.selected_token_ids))
        plain.add_request([1, 5], dataclasses.replace(p, temperature=0.0, seed=None), request_id="r")
        assert normal(of(run(plain), "r")) == normal(of(events, rid))
        verifies = [r for r in eng.trace(rid) if r["kind"] == "spec.verify"]
        assert all(r["rule"] == "rejection" for r in verifies)
    assert accepted > 0
    reasons = [eng.result(r).finish_reason for r in rids]
    assert reasons.count(reason) > len(rids) / 2
    if reason != R.MAX_OUTPUT_TOKENS:       # drafts stop before max_tokens: the last token is never one
        assert any(ended_on_a_kept_draft(eng.trace(r)) for r in rids)


EXACT = [
    pd.SamplingParams(max_tokens=30),                                           # greedy
    pd.SamplingParams(max_tokens=30, temperature=1.0, seed=1, logprobs=0),
    pd.SamplingParams(max_tokens=30, temperature=1.0, seed=2, logprobs=2),
    pd.SamplingParams(max_tokens=30, temperature=1.0, seed=3, repetition_penalty=1.3),
    pd.SamplingParams(max_tokens=30, temperature=1.0, seed=4, presence_penalty=0.5),
    pd.SamplingParams(max_tokens=30, temperature=1.0, seed=5, logit_bias={6: 1.0}),
]


def test_requests_the_rule_does_not_cover_keep_the_exact_path():
    """Greedy, logprobs, penalties, logit_bias: their tokens equal the plain engine's token for
    token, and every verify run of theirs was an exact match."""
    prompts = [[1, 5]] * len(EXACT)
    want = [(o.token_ids, o.logprobs, o.finish_reason) for o in engine(chain(TARGET)).generate(prompts, EXACT)]
    eng = engine(chain(TARGET), speculative=draft_config(chain(DRAFT)))
    rids = [eng.add_request(p, q) for p, q in zip(prompts, EXACT)]
    run(eng)
    got = [(eng.result(r).token_ids, eng.result(r).logprobs, eng.result(r).finish_reason) for r in rids]
    assert got == want
    for rid in rids:
        verifies = [r for r in eng.trace(rid) if r["kind"] == "spec.verify"]
        assert verifies and all(r["rule"] == "match" for r in verifies)
    assert sum(eng.result(r).usage.accepted_draft_tokens for r in rids) > 0


def test_which_requests_take_the_rule():
    def request(output=(), **params):
        r = make_request([5, 6], pd.SamplingParams(max_tokens=20, **params), "r", tokenizer=tokenizer(),
                         vocab_size=V, max_context=1000, rng=random.Random(0), trace_level="lifecycle")
        r.output_ids.extend(output)
        return r

    assert takes_rejection(request(temperature=0.5, top_k=3, top_p=0.9, min_p=0.1))
    assert takes_rejection(request(temperature=0.5, prompt_logprobs=1))
    assert not takes_rejection(request())                                   # greedy
    assert not takes_rejection(request(temperature=1e-7))                   # the sampler's greedy too
    assert not takes_rejection(request(temperature=0.5, logprobs=0))
    assert not takes_rejection(request(temperature=0.5, frequency_penalty=0.1))
    assert not takes_rejection(request(temperature=0.5, logit_bias={5: -1.0}))
    assert not takes_rejection(request(temperature=0.5, min_tokens=2, output=[5]))   # EOS still masked
    assert takes_rejection(request(temperature=0.5, min_tokens=2, output=[5, 6]))
    constrained = request(temperature=0.5)
    constrained.grammar = object()          # any grammar state: its matcher decides per position
    assert not takes_rejection(constrained)


def test_a_draft_with_a_smaller_vocabulary_samples_within_it():
    """A draft whose vocabulary is smaller than the target's: q is 0 past it; the output still
    follows the rule (every draft token within the draft's vocabulary, runs accepted)."""
    small = ScriptedModel(lambda prompt, output: chain(DRAFT)(prompt, output)[:120], vocab_size=120,
                          eos_token_ids=[EOS])
    config = pd.SpeculativeConfig(method="draft", draft_model=small, num_tokens=3, min_acceptance=0.0, min_gain=0.0)
    eng = engine(chain(TARGET), speculative=config)
    rids = [eng.add_request([1, 5], p) for p in seeded(4, max_tokens=20, temperature=1.0)]
    run(eng)
    verifies = [r for rid in rids for r in eng.trace(rid) if r["kind"] == "spec.verify"]
    assert verifies and all(r["rule"] == "rejection" and max(r["drafts"]) < 120 for r in verifies)
    assert sum(eng.result(r).usage.accepted_draft_tokens for r in rids) > 0


def test_non_finite_target_logits_fail_that_request_only():
    """The target returns NaN for one request from its 6th output token on: that request fails
    (model_error, no token from a NaN row), the other in the batch finishes, pages all return."""
    healthy = chain(TARGET)

    def broken(prompt, output):
        if prompt[1] == 6 and len(output) >= 5:
            return torch.full((V,), float("nan"))
        return healthy(prompt, output)

    eng = engine(broken, speculative=draft_config(chain(DRAFT)))
    bad = eng.add_request([1, 6], pd.SamplingParams(max_tokens=30, temperature=1.0, seed=1))
    good = eng.add_request([1, 5], pd.SamplingParams(max_tokens=30, temperature=1.0, seed=2))
    run(eng)
    out = eng.result(bad)
    assert out.state == pd.RequestState.FAILED and out.finish_reason == R.MODEL_ERROR
    assert "non-finite" in out.error and len(out.token_ids) <= 5
    assert eng.result(good).finish_reason == R.MAX_OUTPUT_TOKENS and len(eng.result(good).token_ids) == 30
    assert eng.pool.free_pages == eng.pool.num_pages
