"""The kernels one by one, with pytest-benchmark: decode attention, extend (prefill) attention,
KV write and sampling -- the torch references on every machine, the Triton kernels on CUDA -- and
the compiled CPU forward (csrc/cpu_forward.cpp) for one decode step of a 135M-shaped model.

    make bench     (or: .venv/bin/python -m pytest benchmarks/micro -k ops -o addopts=)

Grouped per op and shape (pytest-benchmark's group), so each table sets the backends of one
shape side by side. extra_info holds the bytes each call must move at least, the GB/s that
makes at the median time, and its fraction of the copy bandwidth measured in the same session.
Shapes: on CPU the 135M model's heads (9 q / 3 kv, d64, float32); on CUDA the kernel goals' shapes
(32 q / 8 kv heads, d128, bfloat16; KERNELS.md).
"""
from __future__ import annotations

import math

import pytest
import torch

from pagedecode.kernels._backend import HAS_TRITON
from pagedecode.kernels.decode_attention import paged_decode_attention
from pagedecode.kernels.extend_attention import paged_extend_attention
from pagedecode.kernels.kv_write import write_kv
from pagedecode.kernels.sampling import make_sampling_inputs, sample
from pagedecode.model.batch import ForwardBatch
from pagedecode.model.config import ModelConfig
from pagedecode.model.kv_cache import KVCache
from pagedecode.model.cpu_forward import cpu_extension_available
from pagedecode.model.llama import LlamaModel

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
HQ, HKV, D, DT = (32, 8, 128, torch.bfloat16) if CUDA else (9, 3, 64, torch.float32)
PAGE = 16
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not (CUDA and HAS_TRITON), reason="Triton kernels are timed on CUDA only"))]


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


@pytest.fixture(scope="session")
def copy_gbs() -> float:
    """Copy bandwidth, read + write, of a buffer far beyond the last-level cache."""
    import time
    n = (1 << 30 if CUDA else 1 << 27) // 4
    x = torch.ones(n, device=DEVICE)
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(5):
        sync()
        t = time.perf_counter()
        y.copy_(x)
        sync()
        best = min(best, time.perf_counter() - t)
    return 2 * x.numel() * 4 / best / 1e9


def report(benchmark, nbytes: int, copy_gbs: float, **extra) -> None:
    s = benchmark.stats.stats.median
    benchmark.extra_info.update(bytes=nbytes, GBps=round(nbytes / s / 1e9, 2),
                                of_copy_bandwidth=round(nbytes / s / 1e9 / copy_gbs, 3),
                                copy_GBps=round(copy_gbs, 1), median_us=round(s * 1e6, 1), **extra)


def timed(fn):
    def call():
        out = fn()
        sync()
        return out
    return call


def paged(batch: int, ctx: int):
    """A pool with each sequence's pages scattered at random, and its page table."""
    per = -(-ctx // PAGE)
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(batch * per, PAGE, HKV, D, generator=g).to(DEVICE, DT)
    vc = torch.randn(batch * per, PAGE, HKV, D, generator=g).to(DEVICE, DT)
    table = torch.randperm(batch * per, generator=g).to(torch.int32).view(batch, per).to(DEVICE)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
    return kc, vc, table, lens


DECODE_SHAPES = [(64, 4096), (1, 32768)] if CUDA else [(16, 512), (1, 2048)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch,ctx", DECODE_SHAPES, ids=[f"B{b}-ctx{c}" for b, c in DECODE_SHAPES])
def test_decode_attention(benchmark, copy_gbs, backend, batch, ctx):
    benchmark.group = f"decode attention B={batch} ctx={ctx}"
    kc, vc, table, lens = paged(batch, ctx)
    q = torch.randn(batch, HQ, D, device=DEVICE).to(DT)
    benchmark(timed(lambda: paged_decode_attention(q, kc, vc, table, lens, backend=backend)))
    el = kc.element_size()
    report(benchmark, 2 * batch * ctx * HKV * D * el + 2 * batch * HQ * D * el, copy_gbs)


EXTEND_SHAPES = [(1, 8192), (8, 1024)] if CUDA else [(1, 512), (4, 128)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seqs,n", EXTEND_SHAPES, ids=[f"{s}x{n}" for s, n in EXTEND_SHAPES])
def test_extend_attention(benchmark, copy_gbs, backend, seqs, n):
    """Causal prefill of `seqs` sequences of n new tokens each (no cached prefix)."""
    benchmark.group = f"extend attention {seqs} x {n} new tokens"
    kc, vc, table, lens = paged(seqs, n)
    q = torch.randn(seqs * n, HQ, D, device=DEVICE).to(DT)
    cu = torch.arange(0, seqs * n + 1, n, dtype=torch.int32, device=DEVICE)
    benchmark(timed(lambda: paged_extend_attention(q, kc, vc, table, cu, lens, backend=backend, max_new=n)))
    el = kc.element_size()
    flops = seqs * 4 * n * n * HQ * D / 2                    # QK^T and PV over the causal half
    report(benchmark, 2 * seqs * n * HKV * D * el + 2 * seqs * n * HQ * D * el, copy_gbs,
           TFLOPs=round(flops / benchmark.stats.stats.median / 1e12, 3))


KV_TOKENS = [8192, 64] if CUDA else [256, 16]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tokens", KV_TOKENS, ids=[f"T{t}" for t in KV_TOKENS])
def test_kv_write(benchmark, copy_gbs, backend, tokens):
    benchmark.group = f"kv write T={tokens}"
    kc, vc, _, _ = paged(64, 1024)
    g = torch.Generator().manual_seed(1)
    slots = torch.randperm(kc.shape[0] * PAGE, generator=g)[:tokens].to(DEVICE)
    k = torch.randn(tokens, HKV, D, device=DEVICE).to(DT)
    v = torch.randn(tokens, HKV, D, device=DEVICE).to(DT)
    benchmark(timed(lambda: write_kv(kc, vc, k, v, slots, backend=backend)))
    assert torch.equal(kc.view(-1, HKV, D)[slots], k)
    report(benchmark, 2 * 2 * tokens * HKV * D * k.element_size(), copy_gbs)


SAMPLING = [(64, 128256)] if CUDA else [(16, 49152), (1, 49152)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["greedy", "T0.8-k50-p0.9"])
@pytest.mark.parametrize("rows,vocab", SAMPLING, ids=[f"{b}x{v}" for b, v in SAMPLING])
def test_sampling(benchmark, copy_gbs, backend, mode, rows, vocab):
    benchmark.group = f"sampling {rows}x{vocab} {mode}"
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(2)).to(DEVICE) * 4
    t, k, p = (0.0, 0, 1.0) if mode == "greedy" else (0.8, 50, 0.9)
    inp = make_sampling_inputs([t] * rows, [k] * rows, [p] * rows, [0.0] * rows, list(range(rows)), [0] * rows,
                               device=DEVICE)
    benchmark(timed(lambda: sample(logits, inp, backend=backend)))
    report(benchmark, rows * vocab * 4, copy_gbs)


# -- the compiled CPU forward, one decode step of a model of SmolLM-135M's shape -------------
def model_135m(dtype: torch.dtype) -> LlamaModel:
    cfg = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64, max_position_embeddings=2048, rms_norm_eps=1e-5)
    g = torch.Generator().manual_seed(3)
    w: dict[str, torch.Tensor] = {}

    def put(name: str, *shape: int) -> None:
        w[name] = 0.05 * torch.randn(*shape, generator=g)

    hid, inter = cfg.hidden_size, cfg.intermediate_size
    put("model.embed_tokens.weight", cfg.vocab_size, hid)
    w["lm_head.weight"] = w["model.embed_tokens.weight"]
    w["model.norm.weight"] = torch.ones(hid)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(hid)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hid)
        put(p + "self_attn.q_proj.weight", 576, hid)
        put(p + "self_attn.k_proj.weight", 192, hid)
        put(p + "self_attn.v_proj.weight", 192, hid)
        put(p + "self_attn.o_proj.weight", hid, 576)
        put(p + "mlp.gate_proj.weight", inter, hid)
        put(p + "mlp.up_proj.weight", inter, hid)
        put(p + "mlp.down_proj.weight", hid, inter)
    return LlamaModel(cfg, w, dtype=dtype)


@pytest.mark.skipif(CUDA or not cpu_extension_available(), reason="the compiled CPU forward (csrc/) is CPU-only")
@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_forward_decode_step(benchmark, copy_gbs, dtype, batch):
    """One decode step (each sequence 64 tokens of context): bound by reading every weight once."""
    benchmark.group = f"cpu forward, 135M decode step, batch {batch}"
    dt = getattr(torch, dtype)
    model = model_135m(dt)
    ctx = 64
    per = ctx // PAGE + 1
    kv = KVCache(30, batch * per, PAGE, 3, 64, dt)
    table = torch.arange(batch * per, dtype=torch.int32).view(batch, per)
    pos = torch.full((batch,), ctx, dtype=torch.long)
    b = ForwardBatch(torch.randint(0, 49152, (batch,)), pos, table[:, ctx // PAGE].long() * PAGE + ctx % PAGE,
                     table, torch.full((batch,), ctx + 1, dtype=torch.int32),
                     torch.arange(batch + 1, dtype=torch.int32), torch.arange(batch), num_decode=batch, max_new=1)
    assert model.uses_cpu_extension()
    benchmark(lambda: model.forward(b, kv))
    weights = sum(t.numel() * t.element_size() for t in model._compiled.tensors()) + model.lm_head.numel() * \
        model.lm_head.element_size()
    report(benchmark, weights, copy_gbs, tokens_per_s=round(batch / benchmark.stats.stats.median, 1),
           threads=torch.get_num_threads())
    assert math.isfinite(float(model.forward(b, kv).sum()))
