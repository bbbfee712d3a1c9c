"""Random tiny checkpoints of each supported family, written by transformers inside the test:
greedy tokens identical to transformers' generate, prefill logits within 1e-4 in float32."""
import shutil
import zlib

import pytest
import torch

import pagedecode as pd
from pagedecode.testing import prefill_batch

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False)
FAMILIES = {
    "llama2": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3-rope-scaling": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32}, rope_theta=500000.0)),
    "llama-tied-gqa5": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=5, num_key_value_heads=1,
                                                                 hidden_size=80, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "qwen2-bias": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3-qknorm": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
}
PROMPTS = [[1, 403, 407, 261, 378], [1, 291, 280, 294, 17, 99, 300, 12, 45, 46, 47, 48, 400, 3, 4, 5, 6, 7],
           [1, 5]]


def make_checkpoint(path, family, stories_path):
    cfg_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, cfg_name)(**{**BASE, **extra})
    torch.manual_seed(zlib.crc32(family.encode()))
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():     # random everything, biases and norms too
            p.normal_(1.0 if "norm" in name else 0.0, 0.3 if "norm" in name else 0.15)
    model.save_pretrained(path, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(stories_path / f, path / f)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory, stories_path):
    path = tmp_path_factory.mktemp(request.param)
    return path, make_checkpoint(path, request.param, stories_path)


def hf_greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def test_greedy_tokens_match_transformers(checkpoint):
    path, hf = checkpoint
    engine = pd.Engine.from_pretrained(path, page_size=8, max_tokens_per_step=11)
    outs = engine.generate(PROMPTS, pd.SamplingParams(max_tokens=20, ignore_eos=True))
    for ids, out in zip(PROMPTS, outs):
        assert out.selected_token_ids == hf_greedy(hf, ids, 20)


def test_prefill_logits_match_transformers(checkpoint):
    path, hf = checkpoint
    model, _ = pd.load_model(path)
    ids = PROMPTS[1]
    kv = pd.KVCache(model.config.num_layers, 4, 8, model.config.num_kv_heads, model.config.head_dim, torch.float32)
    ours = model.forward(prefill_batch(ids, pages=[3, 0, 2], page_size=8), kv)      # pages out of order
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert ((ours - ref).norm() / ref.norm()).item() < 1e-4


@pytest.mark.parametrize("dtype,tol", [("bfloat16", 5e-2), ("float16", 1e-2)])
def test_half_precision_runs_close_to_float32(checkpoint, dtype, tol):
    path, hf = checkpoint
    model, _ = pd.load_model(path, dtype=dtype)
    assert model.dtype == getattr(torch, dtype)
    ids = PROMPTS[1]
    kv = pd.KVCache(model.config.num_layers, 3, 8, model.config.num_kv_heads, model.config.head_dim, model.dtype)
    ours = model.forward(prefill_batch(ids, pages=[2, 0, 1], page_size=8), kv)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert ((ours - ref).norm() / ref.norm()).item() < tol
    engine = pd.Engine.from_pretrained(path, dtype=dtype)
    out = engine.generate(PROMPTS, pd.SamplingParams(max_tokens=4, ignore_eos=True))
    assert [len(o.selected_token_ids) for o in out] == [4, 4, 4]
