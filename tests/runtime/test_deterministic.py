"""Deterministic mode (EngineConfig.deterministic): a request's logits are the same bits whatever
else runs -- other requests, chunked prefill, the prefix cache, preemption, the thread count."""
from __future__ import annotations

import functools

import pytest
import torch

import pagedecode as pd
from pagedecode import cli
from pagedecode.runtime.config import EngineConfig


def test_the_option_reaches_the_model_and_the_trace(stories_path):
    engine = pd.Engine.from_pretrained(stories_path, deterministic=True, trace="tokens")
    assert engine.config.deterministic and engine.model.deterministic
    out = engine.generate("Once upon a time", pd.SamplingParams(max_tokens=2))[0]
    added = [r for r in engine.trace(out.request_id) if r["kind"] == "added"]
    assert added and added[0]["deterministic"] is True
    plain = pd.Engine.from_pretrained(stories_path)
    assert not plain.model.deterministic
    with pytest.raises(ValueError, match="deterministic"):
        EngineConfig(deterministic="yes")  # type: ignore[arg-type]


def test_a_model_without_a_deterministic_forward_is_refused(stories_path):
    engine = pd.Engine.from_pretrained(stories_path)

    class Plain:
        config, device, dtype = engine.model.config, torch.device("cpu"), torch.float32

        def forward(self, batch, kv):
            raise AssertionError("never called")
    with pytest.raises(ValueError, match="batch-invariant"):
        pd.Engine(Plain(), engine.tokenizer, EngineConfig(deterministic=True))


def test_the_flag_on_generate_demo_and_serve():
    ap = cli.build_parser()
    for cmd in (["generate", "--prompt", "x"], ["demo"]):
        assert ap.parse_args(cmd + ["--deterministic"]).deterministic is True
        assert ap.parse_args(cmd).deterministic is False
    assert ap.parse_args(["serve", "--deterministic"]).engine_deterministic is True
    assert ap.parse_args(["serve", "--deterministic", "false"]).engine_deterministic is False
    assert ap.parse_args(["serve"]).engine_deterministic is False


# -- the needle: one request's logprobs alone and inside other load ----------------------------
import random  # noqa: E402

from pagedecode.model.config import ModelConfig  # noqa: E402
from pagedecode.model.cpu_forward import cpu_extension_available  # noqa: E402
from pagedecode.model.llama import LlamaModel  # noqa: E402

needs_ext = pytest.mark.skipif(not cpu_extension_available(), reason="deterministic CPU mode needs pagedecode._cpu")
NEEDLE_TOKENS = 4
LAYERS_135M = 4


def random_135m(dtype: torch.dtype) -> LlamaModel:
    """A random Llama of SmolLM-135M's shape (benchmarks/engine_vs_hf.py's llama135m), built in memory,
    with LAYERS_135M of its 30 layers: every layer runs the same kernels at the same sizes, so a few
    show the batch invariance as well as 30 do, at a fraction of the time."""
    c = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_layers=LAYERS_135M, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                    rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=True, eos_token_ids=(2,))
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.06).to(dtype)
    w = {"model.embed_tokens.weight": rnd(49152, 576), "model.norm.weight": torch.ones(576, dtype=dtype)}
    for i in range(LAYERS_135M):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = w[p + "post_attention_layernorm.weight"] = torch.ones(576, dtype=dtype)
        for n, shape in (("self_attn.q_proj", (576, 576)), ("self_attn.k_proj", (192, 576)),
                         ("self_attn.v_proj", (192, 576)), ("self_attn.o_proj", (576, 576)),
                         ("mlp.gate_proj", (1536, 576)), ("mlp.up_proj", (1536, 576)),
                         ("mlp.down_proj", (576, 1536))):
            w[p + n + ".weight"] = rnd(*shape)
    return LlamaModel(c, w, dtype=dtype)


_models: dict = {}


@pytest.fixture(params=["stories260k", "llama135m"])
def model_name(request):
    return request.param


def get_model(name: str, dtype: torch.dtype, stories_path):
    """(model, tokenizer), one per name and dtype for the module (the 135M model takes a while)."""
    key = (name, dtype)
    if key not in _models:
        tok = pd.Engine.from_pretrained(stories_path).tokenizer
        if name == "llama135m":
            _models[key] = (random_135m(dtype), tok)
        else:
            model, tok = pd.load_model(stories_path, dtype=dtype)
            _models[key] = (model, tok)
    return _models[key]


def make_engine(model, tok, deterministic=True, **options):
    """An engine around the shared model (page_size stays 16 throughout: the attention kernel walks
    the context page by page, so the page size is part of the configuration, like the dtype)."""
    model.deterministic = deterministic          # the same model object serves both modes here
    options.setdefault("max_cache_tokens", 2048)
    return pd.Engine(model, tok, EngineConfig(deterministic=deterministic, **options))


def needle_prompt(vocab: int = 512) -> list[int]:
    rng = random.Random(22)
    return [1] + [rng.randrange(3, vocab) for _ in range(36)]


def random_load(rng: random.Random, k: int, long: bool) -> list[tuple[list[int], int]]:
    """k requests of random prompt lengths, some finishing after one token"""
    hi, out = (60, 8) if long else (10, 3)
    return [([1] + [rng.randrange(3, 512) for _ in range(rng.randint(0, hi))], rng.randint(1, out))
            for _ in range(k)]


def run_needle(engine, others=(), late=None, repeat=1, ids=None):
    """The needle's chosen tokens, logprobs and top logprobs; `others` queued first, `late` =
    {step: requests} added while it runs. repeat=2 runs it twice (the second from the prefix cache);
    `ids` (a list) gets the needle's request ids."""
    late = dict(late or {})
    for p, m in others:
        engine.add_request(p, pd.SamplingParams(max_tokens=m, ignore_eos=True))
    results = []
    for _ in range(repeat):
        rid = engine.add_request(needle_prompt(), pd.SamplingParams(max_tokens=NEEDLE_TOKENS, logprobs=3,
                                                                    ignore_eos=True))
        if ids is not None:
            ids.append(rid)
        step = 0
        while engine.has_unfinished():
            for p, m in late.pop(step, []):
                engine.add_request(p, pd.SamplingParams(max_tokens=m, ignore_eos=True))
            engine.step()
            step += 1
        out = engine.result(rid)
        results.append((out.selected_token_ids, out.logprobs, out.top_logprobs))
    return results if repeat > 1 else results[0]


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_needle_alone_and_in_batches_of_2_7_31(model_name, dtype, stories_path):
    model, tok = get_model(model_name, dtype, stories_path)
    long = model_name == "stories260k"
    alone = run_needle(make_engine(model, tok))
    rng = random.Random(7)
    for k in (2, 7, 31):
        early = random_load(rng, k // 2, long)
        late = {1: random_load(rng, (k - k // 2) // 2, long), 3: random_load(rng, k - k // 2 - (k - k // 2) // 2, long)}
        got = run_needle(make_engine(model, tok), early, late)
        assert got == alone, (model_name, dtype, k)


@needs_ext
@pytest.mark.parametrize("kv", ["float16", "int8", "fp8_e4m3"])
def test_needle_on_a_narrower_cache_alone_and_in_a_batch(stories_path, kv):
    """kv_cache_dtype="float16" / "int8" / "fp8_e4m3" under a float32 model keeps the batch
    invariance: K/V are rounded (8-bit: quantized with their own row's scale) as they are written,
    whatever the batch, and attention over them is the same fixed order."""
    model, tok = get_model("stories260k", torch.float32, stories_path)
    alone = run_needle(make_engine(model, tok, kv_cache_dtype=kv))
    engine = make_engine(model, tok, kv_cache_dtype=kv)
    assert engine.kv.k.dtype == EngineConfig(kv_cache_dtype=kv).kv_dtype(torch.float32)
    assert model._compiled.runs(engine.kv)
    rng = random.Random(8)
    assert run_needle(engine, random_load(rng, 5, True), {2: random_load(rng, 6, True)}) == alone
    assert alone != run_needle(make_engine(model, tok)), f"the {kv} cache changed no logprob: not in use?"


@needs_ext
def test_without_deterministic_the_needle_moves(stories_path):
    """The needle test can fail: the default kernels (gemv / oneDNN by row count) give other bits.
    Up to 24 rows (kGemvRowsUnpacked) a decode step's rows all take the gemv, whose rows are the
    bits of a 1-row call (csrc/float_gemv.h); 63 neighbours (a third finishing after one token)
    put the needle's first decode rows through oneDNN."""
    model, tok = get_model("llama135m", torch.float32, stories_path)
    alone = run_needle(make_engine(model, tok, deterministic=False))
    rng = random.Random(7)
    batched = [run_needle(make_engine(model, tok, deterministic=False), random_load(rng, k, False))
               for k in (2, 63)]
    assert any(b[1] != alone[1] for b in batched)


@needs_ext
@pytest.mark.parametrize("name,kv", [("stories260k", "auto"), ("llama135m", "auto"), ("stories260k", "int8"),
                                     ("stories260k", "fp8_e4m3")])
def test_needle_under_chunking_prefix_cache_preemption_and_threads(name, kv, stories_path):
    """(An 8-bit cache too: each row quantized with its own scale as it is written, so chunking,
    a prefix-cache hit and a recompute after preemption write the same bytes.)"""
    model, tok = get_model(name, torch.float32, stories_path)
    make = functools.partial(make_engine, kv_cache_dtype=kv)
    alone = run_needle(make(model, tok, enable_prefix_caching=False))
    for mtps in (16, 61):
        assert run_needle(make(model, tok, max_tokens_per_step=mtps), random_load(random.Random(mtps), 3, False)) \
            == alone, mtps
    engine = make(model, tok, max_tokens_per_step=16)
    first, cached = run_needle(engine, repeat=2)
    assert first == alone and cached == alone and engine.snapshot().prefix_cache_hits > 0
    # a pool of 6 pages: the needle (37 + 4 tokens, 3 pages) is preempted when its neighbours grow,
    # then recomputed
    engine = make(model, tok, max_cache_tokens=96)
    rng = random.Random(5)
    others = [([1] + [rng.randrange(3, 512) for _ in range(13)], 6) for _ in range(3)]
    ids: list[str] = []
    assert run_needle(engine, others, ids=ids) == alone
    assert any(r["kind"] == "preempted" for r in engine.trace(ids[0]))
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert run_needle(make(model, tok), random_load(random.Random(threads), 5, False)) == alone
    finally:
        torch.set_num_threads(before)


@needs_ext
def test_200_identical_greedy_requests_under_random_load(stories_path):
    model, tok = get_model("stories260k", torch.bfloat16, stories_path)
    engine = make_engine(model, tok, max_tokens_per_step=97)
    rng = random.Random(200)
    prompt = "Once upon a time, in a small town,"
    rids = []
    step = 0
    while len(rids) < 200 or engine.has_unfinished():
        if len(rids) < 200:
            for p, m in random_load(rng, rng.randint(0, 3), True):
                engine.add_request(p, pd.SamplingParams(max_tokens=m, ignore_eos=True))
            for _ in range(rng.randint(1, 12)):
                if len(rids) < 200:
                    rids.append(engine.add_request(prompt, pd.SamplingParams(max_tokens=12, logprobs=0)))
        engine.step()
        step += 1
    outs = {(tuple(o.selected_token_ids), tuple(o.logprobs)) for o in (engine.result(r) for r in rids)}
    assert len(outs) == 1


@needs_ext
def test_tensor_parallel_2_against_itself_under_different_batches(stories_path):
    engine = pd.Engine.from_pretrained(stories_path, tensor_parallel_size=2, deterministic=True,
                                       max_tokens_per_step=61)
    try:
        alone = run_needle(engine)
        rng = random.Random(2)
        for k in (2, 7):
            assert run_needle(engine, random_load(rng, k, True), {1: random_load(rng, 2, True)}) == alone
    finally:
        engine.close()


def test_top_logprob_ids_at_equal_values_do_not_depend_on_the_batch(stories_path):
    """A bfloat16 model's logits tie often: which of the tied ids are reported, and in what order,
    is the lower id first, so a request alone and among others reports the same alternatives."""
    eng = pd.Engine.from_pretrained(stories_path, dtype=torch.bfloat16, deterministic=True)
    params = pd.SamplingParams(max_tokens=24, logprobs=8)
    alone = eng.generate(["Once upon a time"], params)[0].top_logprobs
    among = eng.generate(["Lily and Tom", "Once upon a time", "The cat sat on"], [params] * 3)[1].top_logprobs
    assert alone == among
    ties = [(a, b) for tops in alone for a, b in zip(tops, tops[1:]) if a[1] == b[1]]
    assert ties and all(a[0] < b[0] for a, b in ties)
