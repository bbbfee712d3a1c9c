"""Memory a user can predict: after a request, the process holds what it held before loading plus
weight_bytes (one copy of each weight, unless cpu_pack_weights asks for oneDNN's second one; a
quantized load's float layers handed back) plus
the KV cache, whose default size is min(max_batch_size x context, 128 MiB / bytes per token)
tokens. Measured as RSS in a fresh process over a 180 MB float32 model."""
import json
import shutil
import subprocess
import sys

import pytest
import torch

from pagedecode.runtime.config import DEFAULT_KV_BUDGET_BYTES, EngineConfig

SHAPE = dict(vocab_size=512, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
             num_key_value_heads=4, max_position_embeddings=512)

CHILD = """
import gc, json, sys
import torch
import pagedecode as pd
from pagedecode.model import cpu_forward, loader, tokenizer    # imports paid before the baseline

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

path, options = sys.argv[1], json.loads(sys.argv[2])
gc.collect()
before = rss()
engine = pd.Engine.from_pretrained(path, **options)
engine.generate(["the cat sat on the mat " * 20], pd.SamplingParams(max_tokens=16, ignore_eos=True))
gc.collect()
print(json.dumps({"grew": rss() - before, "weight_bytes": engine.weight_bytes,
                  "kv_bytes": engine.kv.k.numel() * engine.kv.k.element_size() * 2,
                  "kv_tokens": engine.kv.num_pages * engine.config.page_size}))
"""


@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    from safetensors.torch import save_file

    from pagedecode.model.default_model import default_model_path
    path = tmp_path_factory.mktemp("mem-model")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_path() / f, path / f)
    g = torch.Generator().manual_seed(7)
    h, f, layers = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_hidden_layers"]
    kv = SHAPE["num_key_value_heads"] * h // SHAPE["num_attention_heads"]

    def w(*shape):
        return torch.randn(*shape, generator=g) * shape[-1] ** -0.5
    weights = {"model.embed_tokens.weight": w(512, h), "model.norm.weight": torch.ones(h), "lm_head.weight": w(512, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        weights.update({p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
                        p + "self_attn.q_proj.weight": w(h, h), p + "self_attn.k_proj.weight": w(kv, h),
                        p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, h),
                        p + "mlp.gate_proj.weight": w(f, h), p + "mlp.up_proj.weight": w(f, h),
                        p + "mlp.down_proj.weight": w(h, f)})
    save_file(weights, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                  "rms_norm_eps": 1e-5, "rope_theta": 10000.0, **SHAPE}))
    return path, sum(t.numel() * 4 for t in weights.values())


def grown(path, **options):
    r = subprocess.run([sys.executable, "-c", CHILD, str(path), json.dumps(options)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


def test_kv_cache_default_is_the_batch_times_the_context_within_the_budget():
    c = EngineConfig(max_batch_size=4)
    assert DEFAULT_KV_BUDGET_BYTES == 128 << 20
    assert c.kv_pages(8192, 512) * 16 == 4 * 512                       # what 4 full contexts need
    assert EngineConfig().kv_pages(46080, 8192) * 16 == 2912          # SmolLM2-135M, float32: the budget binds
    assert EngineConfig().kv_pages(1280, 512) * 16 == 64 * 512        # stories260k: 64 slots fit the budget
    tokens = DEFAULT_KV_BUDGET_BYTES // 4096
    assert EngineConfig().kv_pages(4096, 2048) * 16 == tokens // 16 * 16         # the budget binds
    assert EngineConfig(max_cache_tokens=100).kv_pages(4096, 2048) == 6           # as given, in whole pages
    assert EngineConfig(memory_budget_bytes=1 << 20).kv_pages(4096, 2048) == 16


def test_resident_memory_is_what_the_formula_says(big_model):
    path, checkpoint_bytes = big_model
    got = grown(path, max_batch_size=4, max_context=512)
    assert got["weight_bytes"] == checkpoint_bytes                     # one copy of each weight
    assert got["kv_tokens"] == 4 * 512
    want = got["weight_bytes"] + got["kv_bytes"]
    assert 0.9 * want < got["grew"] < 1.1 * want + (40 << 20), got      # + activations, the allocator's slack
    quantized = grown(path, max_batch_size=4, max_context=512, quantization="q8_0")
    want = quantized["weight_bytes"] + quantized["kv_bytes"]
    assert quantized["weight_bytes"] < 0.3 * checkpoint_bytes
    assert 0.9 * want < quantized["grew"] < 1.1 * want + (40 << 20), quantized
    packed = grown(path, max_batch_size=4, max_context=512, cpu_pack_weights=True)
    if packed["weight_bytes"] > checkpoint_bytes:                      # oneDNN present: its copy is counted
        want = packed["weight_bytes"] + packed["kv_bytes"]
        assert 0.9 * want < packed["grew"] < 1.1 * want + (40 << 20), packed


@pytest.mark.parametrize("command", ["generate", "chat", "demo", "serve"])
def test_kv_cache_memory_on_every_command(command, monkeypatch):
    import pagedecode as pd
    from pagedecode import cli
    from pagedecode.server.flags import engine_options
    args = cli.build_parser().parse_args([command, "--kv-cache-memory", "512M"] + (["--prompt", "x"]
                                                                                   if command == "generate" else []))
    assert args.kv_cache_memory == 512 << 20
    if command == "serve":
        assert engine_options(args)["memory_budget_bytes"] == 512 << 20
        return
    made = {}
    monkeypatch.setattr(pd.Engine, "from_pretrained", classmethod(lambda cls, *a, **k: made.update(k)))
    cli._engine(args)
    assert made["memory_budget_bytes"] == 512 << 20


@pytest.mark.parametrize("text, size", [("1024", 1024), ("2K", 2048), ("1.5G", 3 << 29), ("256MiB", 256 << 20),
                                        ("64mb", 64 << 20)])
def test_byte_sizes(text, size):
    from pagedecode.server.flags import byte_size
    assert byte_size(text) == size


FRAGMENTED = """
import torch
from pagedecode.runtime.process import return_freed_memory

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

big = torch.empty(8 << 18)        # a large block freed: glibc now serves blocks up to 8 MiB from its heap
del big
junk, keep = [], []
for _ in range(200):              # what a load does: 1 MiB blocks freed later, small ones kept between them
    junk.append(torch.ones(1 << 18))
    keep.append(torch.ones(1 << 14))    # 64 KiB, each from the heap top: between the junk blocks
del junk
held = rss()
print(return_freed_memory(), held - rss())
"""


def test_a_load_s_freed_heap_goes_back_to_the_kernel():
    """Freed blocks between kept ones stay in glibc's heap (RSS) until malloc_trim hands them back:
    from_pretrained does after loading (a dequantized SmolLM2 held ~450 MiB more without it)."""
    r = subprocess.run([sys.executable, "-c", FRAGMENTED], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    trimmed, released = r.stdout.split()
    if trimmed != "True":
        pytest.skip("no malloc_trim (not glibc)")
    assert int(released) > 150 << 20
