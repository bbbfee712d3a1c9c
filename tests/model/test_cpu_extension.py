"""The compiled CPU forward (csrc/cpu_forward.cpp) against the torch path, its oracle: random
weights with biases and grouped-query heads, mixed batches of decode rows and prefill chunks over
shuffled pages, pages the batch does not own poisoned with NaN; logits and the KV it writes."""
import os
import random
import shutil
from pathlib import Path

import pytest
import torch

from pagedecode.model.batch import ForwardBatch
from pagedecode.model.config import ModelConfig
from pagedecode.model.kv_cache import KVCache
from pagedecode.model.cpu_forward import cpu_extension_available
from pagedecode.model.llama import LlamaModel

needs_ext = pytest.mark.skipif(not cpu_extension_available(), reason="pagedecode._cpu not built")


def test_extension_is_built_where_a_compiler_is():
    """A machine with a C++ compiler builds the extension (setup.py): a silent fallback to the slow
    path would pass every other test."""
    if os.environ.get("PAGEDECODE_NO_CPU_EXT") == "1" or shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no compiler, or the extension switched off")
    assert cpu_extension_available()


def random_model(dtype, heads=6, kv_heads=2, head_dim=16, bias=True, seed=0, max_pos=128, device="cpu", inter=72,
                 quantization=None):
    cfg = ModelConfig(vocab_size=97, hidden_size=heads * head_dim, intermediate_size=inter, num_layers=2,
                      num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, max_position_embeddings=max_pos,
                      rms_norm_eps=1e-5)
    g = torch.Generator().manual_seed(seed)
    w = {}

    def put(name, *shape, norm=False):    # std 0.1: a model bf16 rounding does not throw into chaos
        w[name] = (1.0 + 0.2 * torch.randn(*shape, generator=g)) if norm else 0.1 * torch.randn(*shape, generator=g)

    hid, q, kv = cfg.hidden_size, heads * head_dim, kv_heads * head_dim
    put("model.embed_tokens.weight", cfg.vocab_size, hid)
    put("lm_head.weight", cfg.vocab_size, hid)
    put("model.norm.weight", hid, norm=True)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        put(p + "input_layernorm.weight", hid, norm=True)
        put(p + "post_attention_layernorm.weight", hid, norm=True)
        for n, out in (("q", q), ("k", kv), ("v", kv)):
            put(p + f"self_attn.{n}_proj.weight", out, hid)
            if bias:
                put(p + f"self_attn.{n}_proj.bias", out)
        put(p + "self_attn.o_proj.weight", hid, q)
        put(p + "mlp.gate_proj.weight", inter, hid)
        put(p + "mlp.up_proj.weight", inter, hid)
        put(p + "mlp.down_proj.weight", hid, inter)
    return LlamaModel(cfg, w, dtype=dtype, device=device, quantization=quantization)


def leading_decode(specs):
    """ForwardBatch.num_decode: the leading sequences with one new row (a one-row prefill of an
    empty sequence later in the batch is not one of them)."""
    n = 0
    while n < len(specs) and specs[n][1] == 1:
        n += 1
    return n


def mixed_batch(rng, page_size, seq_pages, specs):
    """specs: (cached, new) per sequence, decode ones (new == 1) first; seq_pages: each one's pages."""
    ids, pos, slots, cu, lens, table, rows = [], [], [], [0], [], [], []
    width = max(len(p) for p in seq_pages)
    for (c, n), pages in zip(specs, seq_pages):
        for p in range(c, c + n):
            ids.append(rng.randrange(97))
            pos.append(p)
            slots.append(pages[p // page_size] * page_size + p % page_size)
        cu.append(cu[-1] + n)
        lens.append(c + n)
        rows.append(cu[-1] - 1)
        table.append(pages + [-1] * (width - len(pages)))
    return ForwardBatch(torch.tensor(ids), torch.tensor(pos), torch.tensor(slots),
                        torch.tensor(table, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
                        torch.tensor(cu, dtype=torch.int32), torch.tensor(rows),
                        num_decode=leading_decode(specs), max_new=max(n for _, n in specs))


def run(model, batch, kv, backend):
    model.attention_backend = backend
    try:
        return model.forward(batch, kv)
    finally:
        model.attention_backend = "auto"


# float32: both paths round alike, the compiled one is held to the torch path. bfloat16: the two
# round differently (accumulation order), and either was measured up to 5% of the largest logit off
# a float64 run, so both are held to float64 instead (check_against_torch).
TOLERANCES = [(torch.float32, 2e-5), (torch.bfloat16, 0.1)]


@needs_ext
@pytest.mark.parametrize("dtype,tol", TOLERANCES)
@pytest.mark.parametrize("shape", [dict(heads=6, kv_heads=2, head_dim=16), dict(heads=4, kv_heads=4, head_dim=8,
                                                                                 bias=False),
                                   dict(heads=4, kv_heads=2, head_dim=64),       # head sizes compiled in
                                   dict(heads=2, kv_heads=1, head_dim=128, bias=False)])
@pytest.mark.parametrize("page_size", [4, 16, 32])
def test_matches_torch_path_on_mixed_batches(dtype, tol, shape, page_size):
    """Decode rows, short chunks and long ones (the paged kernel walks each in blocks of 8 rows),
    with and without a cached prefix. Pages of 16 or 32 positions take the kernel's 16-keys-at-once
    scores; a context that ends part-way into a page, its tail."""
    model = random_model(dtype, **shape)
    assert model.uses_cpu_extension()
    num_pages = 640 // page_size
    rng = random.Random(1)
    for trial in range(5):
        specs = [(rng.randrange(0, 30), 1) for _ in range(3)] + [
            (0, rng.randrange(2, 12)), (rng.randrange(1, 9), rng.randrange(2, 7)),
            (0, rng.randrange(16, 40)), (rng.randrange(1, 30), rng.randrange(16, 30))]
        if trial >= 3:      # decode steps of 2 and 4 rows: the dot-product gemv (kGemvRows: 2 f32, 4 bf16)
            specs = [(rng.randrange(1, 40), 1) for _ in range(2 if trial == 3 else 4)]
        check_against_torch(model, shape, rng, page_size, num_pages, specs, tol)


@needs_ext
@pytest.mark.parametrize("dtype,tol", TOLERANCES)
def test_long_prefill_chunks_match(dtype, tol):
    """Chunks of kMatmulRows (768) rows or more attend through ATen's fused attention over their
    gathered context, with and without a cached prefix, beside a decode row."""
    shape = dict(heads=4, kv_heads=2, head_dim=32, max_pos=2048)
    check_against_torch(random_model(dtype, **shape), shape, random.Random(2), 16, 128,
                        [(37, 1), (0, 800), (130, 770)], tol)


def check_against_torch(model, shape, rng, page_size, num_pages, specs, tol, kv_dtype=None):
    """One batch of `specs` ((cached, new) per sequence) over shuffled pages, through the compiled
    forward and through the torch path: the same logits and the same KV rows written. `shape`:
    random_model's arguments, for the float64 oracle of a bf16 model. kv_dtype: the caches' dtype
    (default: the model's)."""
    c, dtype = model.config, model.dtype
    kv_dtype = kv_dtype or dtype
    kv_ref = KVCache(c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim, kv_dtype)
    kv_ref.k.fill_(float("nan"))
    kv_ref.v.fill_(float("nan"))
    free = list(range(num_pages))
    rng.shuffle(free)
    seq_pages = [[free.pop() for _ in range(-(-(cc + n) // page_size))] for cc, n in specs]
    # each sequence's cached prefix, written by a prefill through the torch path first
    cached = [(i, cc) for i, (cc, _) in enumerate(specs) if cc]
    prefix = mixed_batch(rng, page_size, [seq_pages[i] for i, _ in cached], [(0, cc) for _, cc in cached])
    run(model, prefix, kv_ref, "torch")
    kv = KVCache(c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim, kv_dtype)
    kv.k.copy_(kv_ref.k)
    kv.v.copy_(kv_ref.v)
    # the same pages again, now with each sequence's new rows after its cached ones
    batch = mixed_batch(rng, page_size, seq_pages, specs)
    want = run(model, batch, kv_ref, "torch")
    got = run(model, batch, kv, "auto")
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.isfinite(got).all()
    scale = max(1.0, float(want.abs().max()))
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=tol * scale, rtol=0)
    else:   # the same weights and cached KV in float64, through the torch path: the oracle of both
        exact = random_model(torch.float64, **shape)
        kv64 = KVCache(c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim, torch.float64)
        kv64.k.copy_(kv_ref.k)
        kv64.v.copy_(kv_ref.v)
        ref = run(exact, batch, kv64, "torch").double()
        err, err_torch = (got.double() - ref).abs(), (want.double() - ref).abs()
        # as accurate as the torch path in bf16, give or take rounding (a misread page is NaN above)
        assert float(err.max()) <= tol * scale, (float(err.max()), scale)
        assert float(err.mean()) <= 1.25 * float(err_torch.mean()) + 1e-3 * scale, (err.mean(), err_torch.mean())
    written = batch.slot_mapping
    for layer in range(c.num_layers):
        for mine, ref in ((kv.k, kv_ref.k), (kv.v, kv_ref.v)):
            a, b = mine[layer].flatten(0, 1)[written].float(), ref[layer].flatten(0, 1)[written].float()
            torch.testing.assert_close(a, b, atol=tol * max(1.0, float(b.abs().max())), rtol=0)


@needs_ext
@pytest.mark.parametrize("kv_dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 1.5e-2)])
@pytest.mark.parametrize("shape", [dict(heads=6, kv_heads=2, head_dim=16), dict(heads=4, kv_heads=2, head_dim=64),
                                   dict(heads=2, kv_heads=1, head_dim=128, bias=False)])
def test_a_16_bit_cache_under_a_float32_model(kv_dtype, tol, shape):
    """kv_cache_dtype="float16" / "bfloat16": the compiled forward rounds K/V once as it writes
    them and widens each page back to float32 to attend; held to the torch path over the same kind
    of cache (decode rows, chunks, a cached prefix, a lone row split over the threads, a chunk long
    enough for the fused prefill attention). The tolerance is the cache's rounding: one path may
    round a K/V value one unit off the other."""
    model = random_model(torch.float32, **shape, max_pos=2048)
    c = model.config
    assert model._compiled is not None and model.uses_cpu_extension()
    assert model._compiled.runs(KVCache(c.num_layers, 4, 16, c.num_kv_heads, c.head_dim, kv_dtype))
    rng = random.Random(3)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            check_against_torch(model, shape, rng, 16, 60, [(rng.randrange(0, 30), 1) for _ in range(3)] +
                                [(0, 9), (5, 4), (0, 20), (12, 17)], tol, kv_dtype)
            check_against_torch(model, shape, rng, 16, 60, [(45, 1)], tol, kv_dtype)
        check_against_torch(model, shape, rng, 16, 120, [(37, 1), (0, 800)], tol, kv_dtype)
    finally:
        torch.set_num_threads(before)


@needs_ext
@pytest.mark.parametrize("dtype,tol", TOLERANCES)
@pytest.mark.parametrize("specs", [[(45, 1)], [(3, 1), (70, 1), (20, 1)], [(30, 5)], [(9, 1), (0, 4)]])
def test_few_rows_attend_on_every_thread(dtype, tol, specs):
    """Under 8 rows (a decode step of a few sequences, a short chunk) a lone sequence's query heads
    split over the threads (on the pool, as the step's matmuls: off_openmp): held to the torch path at
    1, 2, 3 and 4 threads. (test_deterministic_kernels.py: the same bits at every thread count;
    below: a quantized model, and 64 rows of a small float model.)"""
    shape = dict(heads=6, kv_heads=2, head_dim=16)
    model = random_model(dtype, **shape)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3, 4):
            torch.set_num_threads(threads)
            check_against_torch(model, shape, random.Random(5), 16, 40, specs, tol)
    finally:
        torch.set_num_threads(before)


@needs_ext
@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_quantized_few_rows_give_the_same_bits_at_every_thread_count(kind):
    """A quantized model's steps under 8 rows run attention on the spinning pool beside its
    matmuls (a worker's item computed into its scratch, copied out), a lone sequence's query heads
    split over the threads. Every operation's result is fixed whichever thread computes it: the
    logits and the KV written are the same bits at 1 (no pool), 2, 3 and 4 threads, step after
    step; and they stay near the torch path's."""
    shape = dict(heads=6, kv_heads=2, head_dim=16, inter=96)      # every matmul's K a multiple of 32
    model = random_model(torch.float32, **shape, quantization=kind)
    c, page_size, num_pages = model.config, 16, 40
    rng = random.Random(6)
    free = list(range(num_pages))
    rng.shuffle(free)
    specs = [(45, 1), (3, 1), (70, 1), (30, 4)]
    seq_pages = [[free.pop() for _ in range(-(-(cc + n) // page_size))] for cc, n in specs]
    prefix = mixed_batch(rng, page_size, seq_pages, [(0, cc) for cc, _ in specs])
    base = KVCache(c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim, torch.float32)
    run(model, prefix, base, "auto")
    steps = [mixed_batch(random.Random(7 + i), page_size, [seq_pages[s] for s in sel], [specs[s] for s in sel])
             for i, sel in enumerate([[0], [0, 1, 2], [3], [0, 3]])]
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3, 4):
            torch.set_num_threads(threads)
            kv = KVCache(c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim, torch.float32)
            kv.k.copy_(base.k)
            kv.v.copy_(base.v)
            outs.append([run(model, b, kv, "auto") for b in steps for _ in range(5)] + [kv.k.clone(), kv.v.clone()])
    finally:
        torch.set_num_threads(before)
    for got in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], got))
    kv = KVCache(c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim, torch.float32)
    kv.k.copy_(base.k)
    kv.v.copy_(base.v)
    want = run(model, steps[1], kv, "torch")
    torch.testing.assert_close(outs[0][5], want, atol=0.05 * float(want.abs().max()), rtol=0)


@needs_ext
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
def test_a_lone_row_over_a_16_bit_cache_gives_the_same_bits_at_every_thread_count(kv_dtype):
    """A lone decode row's query heads split into an item per thread, and each item widens only
    the kv heads its query heads read from the 16-bit pages (6 heads on 2 kv heads: at 4 threads
    the items hold heads 0 / 1-2 / 3 / 4-5, some reading one kv head of the page, some both): the
    logits and the KV written are the same bits at 1 (one item, the whole page widened), 2, 3 and
    4 threads, step after step."""
    shape = dict(heads=6, kv_heads=2, head_dim=16)
    model = random_model(torch.float32, **shape)
    c, page_size, num_pages = model.config, 16, 12
    rng = random.Random(10)
    free = list(range(num_pages))
    rng.shuffle(free)
    specs = [(45, 1)]
    seq_pages = [[free.pop() for _ in range(-(-(45 + 6) // page_size))]]
    prefix = mixed_batch(rng, page_size, seq_pages, [(0, 45)])
    base = KVCache(c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim, kv_dtype)
    run(model, prefix, base, "auto")
    steps = [mixed_batch(random.Random(11 + i), page_size, seq_pages, [(45 + i, 1)]) for i in range(5)]
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3, 4):
            torch.set_num_threads(threads)
            kv = KVCache(c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim, kv_dtype)
            kv.k.copy_(base.k)
            kv.v.copy_(base.v)
            outs.append([run(model, b, kv, "auto") for b in steps] + [kv.k.clone(), kv.v.clone()])
    finally:
        torch.set_num_threads(before)
    for got in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], got))


@needs_ext
def test_a_small_float_models_64_row_decode_attends_on_the_pool_the_same_bits():
    """64 sequences decoding one row each under a float32 model of small layers (gemv_transposed on
    the caller up to 64 rows): its attention runs on the spinning pool too (off_openmp), a
    worker's items into its scratch, copied out. The logits and the KV written are the same bits at
    1 (no pool), 2, 3 and 4 threads, step after step, and near the torch path's."""
    shape = dict(heads=6, kv_heads=2, head_dim=16)
    model = random_model(torch.float32, **shape)
    c, page_size, num_pages = model.config, 16, 64 * 5
    rng = random.Random(8)
    free = list(range(num_pages))
    rng.shuffle(free)
    specs = [(rng.randrange(20, 60), 1) for _ in range(64)]
    seq_pages = [[free.pop() for _ in range(-(-(cc + n) // page_size))] for cc, n in specs]
    prefix = mixed_batch(rng, page_size, seq_pages, [(0, cc) for cc, _ in specs])
    base = KVCache(c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim, torch.float32)
    run(model, prefix, base, "auto")
    step = mixed_batch(random.Random(9), page_size, seq_pages, specs)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3, 4):
            torch.set_num_threads(threads)
            kv = KVCache(c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim, torch.float32)
            kv.k.copy_(base.k)
            kv.v.copy_(base.v)
            outs.append([run(model, step, kv, "auto") for _ in range(5)] + [kv.k.clone(), kv.v.clone()])
    finally:
        torch.set_num_threads(before)
    for got in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], got))
    kv = KVCache(c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim, torch.float32)
    kv.k.copy_(base.k)
    kv.v.copy_(base.v)
    torch.testing.assert_close(outs[0][0], run(model, step, kv, "torch"), atol=1e-4, rtol=1e-4)


@needs_ext
@pytest.mark.parametrize("rows", [5, 9, 64])
def test_a_chunk_row_equals_its_one_row_forward(rows):
    """A small model's multi-row step (a speculative verify of 1 + k rows, a short chunk) runs its
    layers through the register-tiled gemv_transposed (kSmallGemvRows), 4 rows at a time: every row's
    logits are bit for bit those of the same position run alone (a decode step)."""
    model = random_model(torch.float32, heads=4, kv_heads=2, head_dim=16, bias=False)
    page_size, num_pages = 16, 16
    kv = KVCache(2, num_pages, page_size, 2, 16, torch.float32, torch.device("cpu"))
    ids = torch.tensor(random.Random(3).choices(range(97), k=20 + rows))
    pages = torch.arange(num_pages, dtype=torch.int32).view(1, num_pages)

    def forward(lo, hi):
        pos = torch.arange(lo, hi)
        return model.forward(ForwardBatch(ids[lo:hi], pos, pos.clone(), pages, torch.tensor([hi], dtype=torch.int32),
                                          torch.tensor([0, hi - lo], dtype=torch.int32), torch.arange(hi - lo),
                                          num_decode=int(hi - lo == 1), max_new=hi - lo), kv)

    forward(0, 20)
    chunk = forward(20, 20 + rows)
    alone = torch.cat([forward(p, p + 1) for p in range(20, 20 + rows)])
    assert torch.equal(chunk, alone)


@needs_ext
def test_falls_back_where_it_does_not_apply():
    model = random_model(torch.float32)
    model.attention_backend = "torch"
    assert not model.uses_cpu_extension()
    assert not random_model(torch.float16).uses_cpu_extension()
    # a bfloat16 model keeps its cache in bfloat16: another dtype goes through the torch path
    bf16 = random_model(torch.bfloat16)
    c = bf16.config
    assert bf16._compiled is not None
    assert not bf16._compiled.runs(KVCache(c.num_layers, 4, 16, c.num_kv_heads, c.head_dim, torch.float16))


@needs_ext
def test_aten_matmul_fallback_matches(tmp_path):
    """PAGEDECODE_CPU_MATMUL=aten (at::mm instead of oneDNN's linear) gives the same logits, and
    PAGEDECODE_CPU_PACK=0 (oneDNN on plain weights) bit for bit: the environment sets a model's
    defaults (EngineConfig's too; tests/runtime/test_config.py gives them as fields), read in
    child processes here."""
    import subprocess
    import sys
    code = """
import sys, torch
sys.path.insert(0, {tests!r})
from model.test_cpu_extension import random_model, mixed_batch, run
from pagedecode.model.kv_cache import KVCache
import random
m = random_model(torch.float32, heads=4, kv_heads=2, head_dim=64)
rng = random.Random(3)
kv = KVCache(2, 40, 4, 2, 64, torch.float32)
pages = [list(range(0, 10)), list(range(10, 12)), list(range(12, 20))]
b = mixed_batch(rng, 4, pages, [(0, 1), (0, 8), (0, 30)])
torch.save(run(m, b, kv, "auto"), sys.argv[1])
""".format(tests=str(Path(__file__).resolve().parents[1]))
    outs = []
    for matmul, pack in (("aten", "1"), ("default", "1"), ("default", "0")):
        env = {**os.environ, "PAGEDECODE_CPU_MATMUL": matmul, "PAGEDECODE_CPU_PACK": pack}
        path = tmp_path / f"{matmul}-{pack}.pt"
        subprocess.run([sys.executable, "-c", code, str(path)], check=True, env=env, timeout=120)
        outs.append(torch.load(path))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=0)
    # oneDNN's packed weights (the default) and plain ones: the same kernels, the same bits
    assert torch.equal(outs[1], outs[2])


FREED_MEMORY_CHILD = """
import ctypes, resource, sys, torch
sys.path.insert(0, {tests!r})
from model.test_cpu_extension import random_model
from pagedecode.runtime.config import EngineConfig
from pagedecode.runtime.engine import Engine
from pagedecode.testing import ByteVocabTokenizer
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
model = random_model(torch.float32)    # kept alive, as an engine keeps its model
engine = Engine(model, ByteVocabTokenizer({{i: bytes([65 + i % 26]) for i in range(97)}}),
                EngineConfig(max_cache_tokens=64, cpu_keep_freed_memory={keep}))
size, faults = 8 << 20, [0] * 12
for i in range(12):                   # a "step": three 8 MB activations, written, then freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc(size) for _ in range(3)]
    for b in blocks:
        ctypes.memset(b, 1, size)
    for b in blocks:
        libc.free(b)
    faults[i] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(*faults)
"""


@needs_ext
@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="a glibc malloc setting")
def test_freed_activations_are_reused_not_refaulted():
    """With the compiled forward in use, a step's activations, freed and allocated again, come back
    without new page faults: the engine applies the setting as its config asks
    (cpu_keep_freed_memory; PAGEDECODE_MALLOC=default sets False), never the model's constructor.
    With glibc as it is, the freed top of the heap past twice its mmap threshold goes back to the
    kernel on every step, and every step faults the three blocks' 6,144 pages of 4 KB in again.
    The blocks come from malloc itself: torch's own allocations land in a heap whose top a live
    block sometimes pins, which made the default's faults (and so this test) depend on the machine."""
    import subprocess
    import sys
    tests = str(Path(__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items()
           if k != "PAGEDECODE_MALLOC" and not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}

    def steady_faults(keep):                  # the faults of steps 4-11: the heap has settled by then
        out = subprocess.run([sys.executable, "-c", FREED_MEMORY_CHILD.format(tests=tests, keep=keep)], check=True,
                             env=env, timeout=120, capture_output=True, text=True).stdout.split()
        return [int(f) for f in out[4:]]
    kept, default = steady_faults(True), steady_faults(False)
    assert sum(kept) <= 100, kept                          # here: 0 on every step after the first
    assert all(f >= 6000 for f in default), default        # here: 6,112 on every step
