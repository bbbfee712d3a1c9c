"""EngineConfig (runtime/config.py): the compiled CPU forward's switches are fields whose defaults
come from the environment, and a field given explicitly wins; the engine applies them."""
import pytest
import torch

import pagedecode as pd
from pagedecode.model import cpu_forward
from pagedecode.runtime.config import EngineConfig

SWITCHES = ("PAGEDECODE_CPU_MATMUL", "PAGEDECODE_CPU_PACK", "PAGEDECODE_MALLOC")
needs_ext = pytest.mark.skipif(not cpu_forward.cpu_extension_available(), reason="pagedecode._cpu not built")


@pytest.fixture
def clean_env(monkeypatch):
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_defaults_come_from_the_environment(clean_env):
    c = EngineConfig()          # one resident copy of each weight unless asked (memory a user can predict)
    assert (c.cpu_matmul, c.cpu_pack_weights, c.cpu_keep_freed_memory) == ("onednn", False, True)
    clean_env.setenv("PAGEDECODE_CPU_MATMUL", "aten")
    clean_env.setenv("PAGEDECODE_CPU_PACK", "1")
    clean_env.setenv("PAGEDECODE_MALLOC", "default")
    c = EngineConfig()          # read when a config is made, not when the module was imported
    assert (c.cpu_matmul, c.cpu_pack_weights, c.cpu_keep_freed_memory) == ("aten", True, False)


def test_an_explicit_field_wins_over_the_environment(clean_env):
    clean_env.setenv("PAGEDECODE_CPU_MATMUL", "aten")
    clean_env.setenv("PAGEDECODE_CPU_PACK", "0")
    clean_env.setenv("PAGEDECODE_MALLOC", "default")
    c = EngineConfig(cpu_matmul="onednn", cpu_pack_weights=True, cpu_keep_freed_memory=True)
    assert (c.cpu_matmul, c.cpu_pack_weights, c.cpu_keep_freed_memory) == ("onednn", True, True)
    with pytest.raises(ValueError, match="cpu_matmul"):
        EngineConfig(cpu_matmul="mkl")


@needs_ext
def test_the_engine_packs_the_weights_as_its_config_says(clean_env, stories_path):
    """cpu_pack_weights: the oneDNN-blocked second copy of the weights exists (weight_bytes counts
    it) exactly when the engine's config asks, whatever the environment says; the logits are the
    same bits either way."""
    clean_env.setenv("PAGEDECODE_CPU_PACK", "0")
    prompt = pd.SamplingParams(max_tokens=6, logprobs=0, ignore_eos=True)
    packed = pd.Engine.from_pretrained(stories_path, cpu_pack_weights=True)
    plain = pd.Engine.from_pretrained(stories_path)                 # the environment's default: none
    assert packed.model.uses_cpu_extension() and packed.weight_bytes > plain.weight_bytes
    a, b = packed.generate("Once upon a time", prompt)[0], plain.generate("Once upon a time", prompt)[0]
    assert a.selected_token_ids == b.selected_token_ids and a.logprobs == b.logprobs
    # a model built first, then given to an engine: the engine's config decides
    model = plain.model
    pd.Engine(model, plain.tokenizer, EngineConfig(cpu_pack_weights=True))
    assert model.weight_bytes == packed.weight_bytes
    pd.Engine(model, plain.tokenizer, EngineConfig(cpu_pack_weights=False))
    assert model.weight_bytes == plain.weight_bytes


@needs_ext
def test_cpu_matmul_aten_runs_at_mm_with_the_same_logits(clean_env, stories_path):
    """cpu_matmul="aten" (at::mm for the larger matmuls) per engine, in one process: the same
    logits within float32 rounding as oneDNN's."""
    eng = pd.Engine.from_pretrained(stories_path, cpu_matmul="aten")
    packed = pd.Engine.from_pretrained(stories_path, cpu_pack_weights=True)      # aten needs no oneDNN copy
    assert eng.model._compiled.onednn is False and eng.weight_bytes < packed.weight_bytes
    params = pd.SamplingParams(max_tokens=8, logprobs=0, ignore_eos=True, prompt_logprobs=0)
    prompt = "Once upon a time there was a little girl named Lily who loved to play outside"
    a = eng.generate(prompt, params)[0]
    b = pd.Engine.from_pretrained(stories_path, cpu_matmul="onednn").generate(prompt, params)[0]
    assert a.prompt_logprobs[1:] == pytest.approx(b.prompt_logprobs[1:], abs=1e-4)
    assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


@needs_ext
def test_malloc_is_set_by_the_engine_that_asks_not_by_the_model(clean_env, stories_path, monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_forward._cpu_ext, "keep_freed_memory", lambda: calls.append(1) or True)
    eng = pd.Engine.from_pretrained(stories_path, cpu_keep_freed_memory=False)
    assert calls == []                          # neither the model's constructor nor this engine
    pd.Engine(eng.model, eng.tokenizer, EngineConfig(cpu_keep_freed_memory=True))
    assert calls == [1]
    clean_env.setenv("PAGEDECODE_MALLOC", "default")
    pd.Engine(eng.model, eng.tokenizer, EngineConfig())
    assert calls == [1]
    # torch path (no compiled forward): nothing to keep, nothing asked
    pd.Engine(eng.model, eng.tokenizer, EngineConfig(attention_backend="torch", cpu_keep_freed_memory=True))
    assert calls == [1] and isinstance(eng.model.embed, torch.Tensor)


def test_kv_cache_dtype_takes_the_usual_names_and_refuses_others():
    assert EngineConfig().kv_cache_dtype == "auto"
    assert EngineConfig().kv_dtype(torch.bfloat16) == torch.bfloat16
    for name, dtype in (("float16", torch.float16), ("FP16", torch.float16), ("bf16", torch.bfloat16),
                        ("float32", torch.float32), ("half", torch.float16), (torch.bfloat16, torch.bfloat16),
                        ("AUTO", None), ("int8", torch.int8), (torch.int8, torch.int8), ("FP8_E4M3", torch.float8_e4m3fn),
                        ("float8_e4m3fn", torch.float8_e4m3fn)):
        config = EngineConfig(kv_cache_dtype=name)
        assert config.kv_dtype(torch.float32) == (dtype or torch.float32)
        assert config.kv_cache_dtype == {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.int8: "int8",
                                         torch.float8_e4m3fn: "fp8_e4m3", torch.float32: "float32",
                                         None: "auto"}[dtype]
    for bad in ("fp8", "int4", "", " float16", None, 16, torch.uint8, torch.float8_e5m2, torch.float64):
        with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, bfloat16, float16"):
            EngineConfig(kv_cache_dtype=bad)


def test_a_tensor_parallel_model_keeps_its_own_kv_dtype(stories_path):
    """Its worker ranks allocate their caches in the model's dtype: another is refused by name
    before anything is allocated (the model here only says it is sharded)."""
    model, tokenizer = pd.load_model(stories_path)
    model.world = 2
    with pytest.raises(ValueError, match="kv_cache_dtype='float16': a tensor-parallel model's KV cache"):
        pd.Engine(model, tokenizer, EngineConfig(kv_cache_dtype="float16"))
    pd.Engine(model, tokenizer, EngineConfig(kv_cache_dtype="float32")).close()     # its own dtype: taken


@pytest.mark.parametrize("kv", ["float16", "float32"])
def test_a_narrower_model_keeps_its_own_kv_dtype(stories_path, kv):
    """Only a float32 model's cache may differ from it: a bfloat16 model's is bfloat16 (its
    deterministic kernels and compiled forward attend over their own dtype)."""
    model, tokenizer = pd.load_model(stories_path, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"kv_cache_dtype='{kv}' needs a float32 model: this one computes in "
                                         "torch.bfloat16"):
        pd.Engine(model, tokenizer, EngineConfig(kv_cache_dtype=kv))
    engine = pd.Engine(model, tokenizer, EngineConfig(kv_cache_dtype="bfloat16"))
    assert engine.kv.k.dtype == torch.bfloat16
    engine.close()


def test_a_model_the_engine_refuses_is_closed(stories_path):
    """from_pretrained: when the engine refuses the model it just loaded (an option that does not
    fit it), the model's close() runs before the error goes up (a tensor-parallel model's worker
    processes stop then, not at exit)."""
    from pagedecode.runtime import loading
    model, tokenizer = pd.load_model(stories_path, dtype=torch.bfloat16)
    closed = []
    model.close = lambda: closed.append(True)
    with pytest.raises(ValueError, match="needs a float32 model"):
        loading._engine(pd.Engine, model, tokenizer, EngineConfig(kv_cache_dtype="float16"))
    assert closed == [True]
