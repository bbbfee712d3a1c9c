"""8-bit KV caches (kv_cache_dtype "int8" / "fp8_e4m3") through the engine: the capacity a byte
budget buys, and every feature that moves K/V around -- the prefix cache, preemption, speculation
(rejected K/V never read), chunked prefill -- paired with one: each gives the tokens and logprobs
the same engine gives with the same cache dtype and without the feature."""
import pytest
import torch

import pagedecode as pd
from pagedecode.model.kv_cache import KVCache
from pagedecode.runtime.config import DEFAULT_KV_BUDGET_BYTES, EngineConfig

from .helpers import poison_past_lengths

QUANT = ["int8", "fp8_e4m3"]
NGRAM = pd.SpeculativeConfig(method="ngram", num_tokens=4, min_ngram=2, max_ngram=4)
PARAMS = [pd.SamplingParams(max_tokens=24, logprobs=2), pd.SamplingParams(max_tokens=24, temperature=0.8, seed=4)]


@pytest.fixture(scope="module")
def grounded_prompt(stories_path):
    """A passage the model then reproduces (its own greedy continuation given back), so n-gram
    drafts are accepted (as test_speculative.py's)."""
    eng = pd.Engine.from_pretrained(stories_path)
    text = eng.generate("Once upon a time", pd.SamplingParams(max_tokens=60))[0].text
    return "Once upon a time" + text + "\nOnce upon a time"


def outputs(engine, prompts, params):
    return [(o.token_ids, o.text, o.logprobs, o.top_logprobs, o.finish_reason)
            for o in engine.generate(prompts, params)]


@pytest.mark.parametrize("kv,dtype", [("int8", torch.int8), ("fp8_e4m3", torch.float8_e4m3fn)])
def test_the_names_the_cache_and_its_bytes(stories_engine_factory, kv, dtype):
    """The option's names, the cache's dtype and scales, and the bytes a token costs: head_dim bytes
    and a bfloat16 scale per layer, KV head and K / V; so a byte budget (memory_budget_bytes, and the
    default budget) holds 1.94x a float16 cache's tokens at head_dim 64 (each count exact)."""
    assert EngineConfig(kv_cache_dtype=kv).kv_cache_dtype == kv
    assert EngineConfig(kv_cache_dtype=dtype).kv_cache_dtype == kv
    L, H, D = 30, 3, 64                                               # SmolLM2-135M's cache shape
    assert KVCache.bytes_per_token(L, H, D, dtype) == 2 * L * H * (D + 2) == 11880      # float16: 23040
    assert KVCache.bytes_per_token(L, H, D, torch.float16) == 2 * L * H * D * 2
    budget = 1 << 20
    half = stories_engine_factory(kv_cache_dtype="float16", memory_budget_bytes=budget)
    eight = stories_engine_factory(kv_cache_dtype=kv, memory_budget_bytes=budget)
    c = eight.model.config
    assert eight.kv.k.dtype == dtype and eight.kv.k_scale.shape == (*eight.kv.k.shape[:-1], 1)
    assert eight.kv.k_scale.dtype == eight.kv.v_scale.dtype == torch.bfloat16
    assert eight.bytes_per_token == 2 * c.num_layers * c.num_kv_heads * (c.head_dim + 2)
    assert eight.pool.num_pages == budget // eight.bytes_per_token // eight.config.page_size
    held = sum(t.nbytes for t in (eight.kv.k, eight.kv.v, eight.kv.k_scale, eight.kv.v_scale))
    assert held == eight.pool.num_pages * eight.config.page_size * eight.bytes_per_token <= budget
    # stories260k's head_dim 8 makes the scale a fifth of the row: 16 / (8 + 2) of float16's tokens
    # (to the whole pages each budget holds)
    assert 1.59 < eight.pool.num_pages / half.pool.num_pages <= 1.6
    default = stories_engine_factory(kv_cache_dtype=kv, max_batch_size=4096)
    assert default.pool.num_pages == DEFAULT_KV_BUDGET_BYTES // default.bytes_per_token // default.config.page_size


@pytest.mark.parametrize("kv", QUANT)
def test_prefix_cache_hits_give_the_tokens_of_a_cold_cache(stories_engine_factory, grounded_prompt, kv):
    """Pages written (quantized) for one request and read by the next: the same outputs as with
    prefix caching off. Scales live at the same slots as the rows they belong to."""
    prompts = [grounded_prompt, grounded_prompt + " Then", grounded_prompt]
    cold = stories_engine_factory(kv_cache_dtype=kv, enable_prefix_caching=False)
    want = [outputs(cold, [p], PARAMS[0]) for p in prompts]
    warm = stories_engine_factory(kv_cache_dtype=kv)
    assert [outputs(warm, [p], PARAMS[0]) for p in prompts] == want
    assert warm.snapshot().prefix_cache_hits > 0


@pytest.mark.parametrize("kv", QUANT)
def test_chunked_prefill_gives_the_tokens_of_one_chunk(stories_engine_factory, grounded_prompt, kv):
    prompts = [grounded_prompt, "Once upon a time"]
    want = outputs(stories_engine_factory(kv_cache_dtype=kv), prompts, PARAMS)
    assert outputs(stories_engine_factory(kv_cache_dtype=kv, max_tokens_per_step=7), prompts, PARAMS) == want


@pytest.mark.parametrize("kv", QUANT)
def test_preemption_and_speculation_give_the_plain_tokens(stories_engine_factory, grounded_prompt, kv):
    """Speculation alone, and with preemption in a pool too small for the batch (recomputed K/V
    are quantized again from the same rows: the same bytes and scales)."""
    params = [pd.SamplingParams(max_tokens=36, temperature=0.9, seed=s) for s in range(3)] + \
        [pd.SamplingParams(max_tokens=36)]
    prompts = [grounded_prompt, "Once upon a time", "Lily and Tom", grounded_prompt]
    want = outputs(stories_engine_factory(kv_cache_dtype=kv), prompts, params)
    spec = stories_engine_factory(kv_cache_dtype=kv, speculative=NGRAM)
    assert outputs(spec, prompts, params) == want
    assert spec.snapshot().spec_decode_num_accepted_tokens > 0
    tight = stories_engine_factory(kv_cache_dtype=kv, speculative=NGRAM, page_size=4, max_cache_tokens=120,
                                   enable_prefix_caching=False)
    assert outputs(tight, prompts, params) == want
    assert tight.snapshot().preemptions > 0
    tight.check_integrity()


@pytest.mark.parametrize("kv", QUANT)
def test_rejected_kv_is_never_read_nan_scale_poison(stories_engine_factory, grounded_prompt, kv):
    """After every step, the scale of every slot past each request's logical length (rejected
    drafts' K/V among them) and of every free page is NaN: a read of any of them would end in NaN
    logits (an int8 row cannot hold NaN; its scale can)."""
    prompts = [grounded_prompt, "Once upon a time"]
    for backend in ("auto", "torch"):     # the compiled forward and the torch reference (other float bits)
        want = outputs(stories_engine_factory(kv_cache_dtype=kv, attention_backend=backend), prompts, PARAMS)
        eng = stories_engine_factory(kv_cache_dtype=kv, speculative=NGRAM, enable_prefix_caching=False,
                                     attention_backend=backend)
        rids = [eng.add_request(p, q) for p, q in zip(prompts, PARAMS)]
        poisoned = 0
        while eng.has_unfinished():
            eng.step()
            poisoned += poison_past_lengths(eng, (eng.kv.k_scale, eng.kv.v_scale))
        got = [(o.token_ids, o.text, o.logprobs, o.top_logprobs, o.finish_reason) for o in map(eng.result, rids)]
        if backend == "auto":
            assert got == want
        else:   # the torch path verifies drafts through SDPA, decodes through a matmul: other last bits
            assert [g[:2] for g in got] == [w[:2] for w in want]
            for g, w in zip(got, want):
                assert g[2] == pytest.approx(w[2], abs=1e-4)
        outs = [eng.result(r) for r in rids]
        assert poisoned > 0 and sum(o.usage.draft_tokens - o.usage.accepted_draft_tokens for o in outs) > 0


@pytest.mark.parametrize("kv", QUANT)
def test_an_8_bit_cache_needs_a_float32_model(stories_path, kv):
    with pytest.raises(ValueError, match=f"kv_cache_dtype='{kv}' needs a float32 model"):
        pd.Engine.from_pretrained(stories_path, dtype="bfloat16", kv_cache_dtype=kv)
