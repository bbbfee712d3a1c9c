"""Prefix caching: identical outputs with the cache on and off, exact hit counts, salts, pressure
with cancels and preemption, a forced hash collision, and a state machine over every invariant."""
import math

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import pagedecode as pd
import pagedecode.runtime.prefix_cache as prefix_cache
from pagedecode.testing import ByteVocabTokenizer, ScriptedModel

S = pd.RequestState


def ids_of(outs):
    return [o.selected_token_ids for o in outs]


def stories_prompts(tok, page):
    base = tok.encode("Once upon a time, there was a little girl named Lily. She loved to play")
    exact = base[:3 * page]                        # an exact multiple of the page size
    return [exact, exact[:-1], base[:3 * page + 1], base[:3 * page - 1] + [400], base[:2 * page + 3], base]


@pytest.mark.parametrize("page", [4, 8])
def test_stories_outputs_identical_with_the_cache_on_and_off(stories_engine_factory, page):
    params = pd.SamplingParams(max_tokens=10)
    off = stories_engine_factory(page_size=page, enable_prefix_caching=False)
    prompts = stories_prompts(off.tokenizer, page)
    want_alone = [ids_of(off.generate([p], params))[0] for p in prompts]
    on = stories_engine_factory(page_size=page)
    got_alone = [ids_of(on.generate([p], params))[0] for p in prompts]      # later ones hit earlier ones
    assert got_alone == want_alone
    assert on.scheduler.cache_hits > 0
    mixed = on.generate(prompts + prompts[::-1], params)                      # in one batch, hits and misses
    assert ids_of(mixed) == want_alone + want_alone[::-1]
    on.check_integrity()
    assert on.pool.free_pages == on.pool.num_pages


@pytest.mark.parametrize("family", ["llama2", "qwen3-qknorm"])
def test_random_checkpoints_identical_with_the_cache(tmp_path, stories_path, family):
    from tests.model.test_hf_parity import PROMPTS, make_checkpoint
    make_checkpoint(tmp_path, family, stories_path)
    params = pd.SamplingParams(max_tokens=12, ignore_eos=True)
    system = PROMPTS[1]
    prompts = [system, system + [7, 8], system[:8], system[:9] + [5], PROMPTS[0]]
    off = pd.Engine.from_pretrained(tmp_path, page_size=4, enable_prefix_caching=False)
    want = [ids_of(off.generate([p], params))[0] for p in prompts]
    on = pd.Engine.from_pretrained(tmp_path, page_size=4)
    assert [ids_of(on.generate([p], params))[0] for p in prompts] == want
    assert ids_of(on.generate(prompts, params)) == want
    assert on.scheduler.cache_hits > 0


def scripted_engine(**config):
    vocab = {i: bytes([97 + i % 26]) for i in range(3, 60)}
    vocab.update({1: b"<s>", 2: b"</s>"})
    model = ScriptedModel(lambda prompt, out: 3 + (sum(prompt) + 7 * len(out)) % 50, vocab_size=64,
                          eos_token_ids=[2])
    config.setdefault("max_cache_tokens", 4096)
    return pd.Engine(model, ByteVocabTokenizer(vocab, bos_token_id=1, eos_token_id=2), pd.EngineConfig(**config))


@pytest.mark.parametrize("system_len, page", [(32, 8), (37, 8), (5, 4), (3, 4), (16, 16)])
def test_exact_hit_counts_and_salts(system_len, page):
    eng = scripted_engine(page_size=page)
    system = [3 + i % 40 for i in range(system_len)]
    first = eng.generate([system + [50]], pd.SamplingParams(max_tokens=2))[0]
    assert first.usage.cached_tokens == 0
    outs = eng.generate([system + [51 + i] for i in range(6)], pd.SamplingParams(max_tokens=2))
    per_request = (system_len // page) * page
    assert [o.usage.cached_tokens for o in outs] == [per_request] * 6
    assert all(o.usage.processed_tokens == system_len + 1 + 1 - per_request for o in outs)   # only what was written
    hits = [r for r in eng.trace(outs[0].request_id) if r["kind"] == "prefix_cache"]
    assert hits[0]["hit_tokens"] == per_request
    salted = eng.generate([system + [52]], pd.SamplingParams(max_tokens=2, cache_salt="tenant-b"))[0]
    assert salted.usage.cached_tokens == 0
    again = eng.generate([system + [53]], pd.SamplingParams(max_tokens=2, cache_salt="tenant-b"))[0]
    assert again.usage.cached_tokens == per_request                     # the same salt shares
    assert eng.scheduler.cache_queries == sum(len(system) + 1 for _ in range(9))


def test_a_hash_collision_never_serves_another_prompts_kv(stories_engine_factory, monkeypatch):
    params = pd.SamplingParams(max_tokens=10)
    off = stories_engine_factory(page_size=4, enable_prefix_caching=False)
    prompts = ["Once upon a time there was", "Lily and Tom went to the park", "The dog ran fast and then"]
    want = ids_of(off.generate(prompts, params))
    monkeypatch.setattr(prefix_cache, "page_key", lambda prev, tokens, ns: b"same")
    on = stories_engine_factory(page_size=4)
    got = [ids_of(on.generate([p], params))[0] for p in prompts]
    assert got == want
    on.check_integrity()


def test_a_colliding_page_from_another_chain_is_never_served(stories_engine_factory, monkeypatch):
    """Reproduction: keys that collide across chains (here: a key of the page's tokens only, as if
    the chained hash collided). B's pages hold the same tokens as A's pages 1 and 2, at another
    place after another prefix: confirming a page by its own tokens served A's K/V (computed after
    A's first page) to B. The whole chain is confirmed (parent page and tokens): B misses."""
    import hashlib
    params = pd.SamplingParams(max_tokens=10, logprobs=0)       # the logprobs show the K/V used
    off = stories_engine_factory(page_size=4, enable_prefix_caching=False)
    a = off.tokenizer.encode("Once upon a time there was a little girl named Lily")
    b = a[4:]                                    # A's pages 1, 2, ... at positions 0, 1, ...
    want = [off.generate([p], params)[0] for p in (a, b)]
    monkeypatch.setattr(prefix_cache, "page_key",
                        lambda prev, tokens, ns: hashlib.sha256(repr((tokens, ns)).encode()).digest())
    on = stories_engine_factory(page_size=4)
    got = [on.generate([p], params)[0] for p in (a, b)]
    assert got[1].usage.cached_tokens == 0
    assert ids_of(got) == ids_of(want)
    assert [o.logprobs for o in got] == [o.logprobs for o in want]
    on.check_integrity()
    again = on.generate([a[:9] + [400]], params)[0]           # the true chain is still served
    assert again.usage.cached_tokens == 8
    on.check_integrity()


def test_pressure_with_cancels_and_preemption(stories_engine_factory):
    """A pool of a dozen pages, many overlapping prompts: integrity every step, the same outputs as
    without pressure, every page free or evictable when idle; freed pages poisoned throughout."""
    base = "Once upon a time, there was a little girl named Lily"
    prompts = [base[:n] for n in (16, 30, 51, 23, 40, 51, 16, 35)] * 2
    params = pd.SamplingParams(max_tokens=8)
    want = ids_of(stories_engine_factory(page_size=4, enable_prefix_caching=False).generate(prompts, params))
    eng = stories_engine_factory(page_size=4, max_cache_tokens=48, max_batch_size=6)
    rids = [eng.add_request(p, params) for p in prompts]
    cancelled = {rids[3], rids[11]}
    step = 0
    while eng.has_unfinished():
        eng.step()
        step += 1
        if step == 3:
            for r in cancelled:
                eng.cancel(r)
        eng.check_integrity()
        free = [p for p, c in enumerate(eng.pool.ref_counts) if c == 0 and p not in eng.pool.page_hash]
        eng.kv.k[:, free] = math.nan
        eng.kv.v[:, free] = math.nan
    assert sum(any(x["kind"] == "preempted" for x in eng.trace(r)) for r in rids) > 0
    readmitted_hits = [x["hit_tokens"] for r in rids for x in eng.trace(r)
                       if x["kind"] == "prefix_cache" and x["readmission"]]
    assert readmitted_hits and max(readmitted_hits) > 0       # a preempted request's pages stayed cached
    for r, w in zip(rids, want):
        out = eng.result(r)
        if r in cancelled:
            assert out.state == S.CANCELLED
        else:
            assert out.selected_token_ids == w
    assert eng.pool.free_pages == eng.pool.num_pages
    assert eng.scheduler.cache_hits > 0


class CacheMachine(RuleBasedStateMachine):
    """add / cancel / step / deadline with random shared prefixes over a tight pool."""

    def __init__(self):
        super().__init__()
        self.eng = scripted_engine(page_size=4, max_cache_tokens=40, max_batch_size=4, max_tokens_per_step=9)
        self.rids = []

    @rule(prefix=st.sampled_from([[5, 6, 7, 8], [5, 6, 7, 8, 9, 10, 11, 12], [20, 21], []]),
          tail=st.lists(st.integers(3, 40), max_size=7), n=st.integers(1, 6), salt=st.sampled_from([None, "x"]),
          deadline=st.sampled_from([None, None, 1e-6]))
    def add(self, prefix, tail, n, salt, deadline):
        prompt = prefix + tail or [3]
        self.rids.append(self.eng.add_request(prompt, pd.SamplingParams(max_tokens=n, cache_salt=salt,
                                                                        deadline_s=deadline)))

    @rule(i=st.integers(0, 50))
    def cancel(self, i):
        if self.rids:
            self.eng.cancel(self.rids[i % len(self.rids)])

    @rule(k=st.integers(1, 4))
    def step(self, k):
        for _ in range(k):
            self.eng.step()
            self.eng.check_integrity()

    @invariant()
    def pool_consistent(self):
        self.eng.check_integrity()

    def teardown(self):
        while self.eng.has_unfinished():
            self.eng.step()
            self.eng.check_integrity()
        assert self.eng.pool.free_pages == self.eng.pool.num_pages
        for r in self.rids:
            out = self.eng.result(r)
            assert out.state.terminal
            # the scripted model checked, every forward, that the pages hold the request's tokens


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


def test_poisoned_evicted_pages_never_affect_another_request(stories_engine_factory):
    params = pd.SamplingParams(max_tokens=8)
    prompts = ["Once upon a time, there was a little", "Lily and Tom went to the park to play"]
    eng = stories_engine_factory(page_size=4, max_cache_tokens=64)
    want = ids_of(eng.generate(prompts, params))
    cached = list(eng.pool.page_hash)
    assert cached
    eng.kv.k[:, cached] = math.nan                # what an evicted page held before reuse
    eng.kv.v[:, cached] = math.nan
    other = eng.generate(["The dog ran and ran and ran away from"] * 3, params)   # evicts under pressure
    assert all(o.state == S.FINISHED for o in other)
    eng.pool.clear_cache()                        # evict what is left
    assert ids_of(eng.generate(prompts, params)) == want
    eng.check_integrity()
