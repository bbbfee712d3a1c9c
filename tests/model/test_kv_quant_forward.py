"""8-bit KV caches (int8 / fp8_e4m3) in the compiled CPU forward (csrc/): the rows it writes and the
logits it gives, held to the torch path over the same kind of cache; and its attention kernel's
batch invariance over them (deterministic mode)."""
import random

import pytest
import torch

from pagedecode.kernels.attention_ref import paged_decode_attention_ref
from pagedecode.kernels.kv_quant import dequantize, quantize_rows
from pagedecode.model.cpu_forward import cpu_ext, cpu_extension_available
from pagedecode.model.kv_cache import KVCache

from .test_cpu_extension import mixed_batch, random_model, run

needs_ext = pytest.mark.skipif(not cpu_extension_available(), reason="needs pagedecode._cpu")
QUANT = [torch.int8, torch.float8_e4m3fn]


def check_quantized_against_torch(model, rng, page_size, num_pages, specs, kv_dtype, tol):
    """One batch of `specs` ((cached, new) per sequence) over shuffled pages: the cached prefixes
    written by the torch path, then the batch through the compiled forward and the torch path.
    Every unwritten slot's scale is NaN, so a read of one shows."""
    c = model.config
    kv_ref = KVCache(c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim, kv_dtype)
    kv_ref.k_scale.fill_(float("nan"))
    kv_ref.v_scale.fill_(float("nan"))
    free = list(range(num_pages))
    rng.shuffle(free)
    seq_pages = [[free.pop() for _ in range(-(-(cc + n) // page_size))] for cc, n in specs]
    cached = [(i, cc) for i, (cc, _) in enumerate(specs) if cc]
    prefix = mixed_batch(rng, page_size, [seq_pages[i] for i, _ in cached], [(0, cc) for _, cc in cached])
    run(model, prefix, kv_ref, "torch")
    kv = KVCache(c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim, kv_dtype)
    for mine, ref in ((kv.k, kv_ref.k), (kv.v, kv_ref.v), (kv.k_scale, kv_ref.k_scale), (kv.v_scale, kv_ref.v_scale)):
        mine.copy_(ref)
    batch = mixed_batch(rng, page_size, seq_pages, specs)
    want = run(model, batch, kv_ref, "torch")
    assert model._compiled.runs(kv)
    got = run(model, batch, kv, "auto")
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    scale = max(1.0, float(want.abs().max()))
    torch.testing.assert_close(got, want, atol=tol * scale, rtol=0)
    # the first layer's rows (its K/V come from the embeddings alone, so the two paths' float K/V
    # differ in the last bits): the same quantized values, or one step apart where a value sits at a
    # rounding boundary (int8: one scale; e4m3: 1/8 of the value, or a scale near zero)
    written = batch.slot_mapping
    for data, sc, data_ref, sc_ref in ((kv.k, kv.k_scale, kv_ref.k, kv_ref.k_scale),
                                       (kv.v, kv.v_scale, kv_ref.v, kv_ref.v_scale)):
        a = dequantize(data[0].flatten(0, 1)[written], sc[0].flatten(0, 1)[written])
        b = dequantize(data_ref[0].flatten(0, 1)[written], sc_ref[0].flatten(0, 1)[written])
        sc_b = sc_ref[0].flatten(0, 1)[written]
        bound = sc_b if data.dtype == torch.int8 else b.abs() / 8 + sc_b
        assert (torch.isfinite(a) & ((a - b).abs() <= bound * 1.01 + 1e-6)).all()


@needs_ext
@pytest.mark.parametrize("kv_dtype,tol", [(torch.int8, 5e-3), (torch.float8_e4m3fn, 3e-2)])
@pytest.mark.parametrize("shape", [dict(heads=6, kv_heads=2, head_dim=16), dict(heads=4, kv_heads=4, head_dim=8),
                                   dict(heads=6, kv_heads=2, head_dim=64),
                                   dict(heads=2, kv_heads=1, head_dim=128, bias=False)])
def test_an_8_bit_cache_under_the_compiled_forward(kv_dtype, tol, shape):
    """Decode rows, chunks, cached prefixes, a lone row split over the threads, and a chunk long
    enough for the fused prefill attention (800 rows): the compiled forward quantizes K/V as it
    writes them and attends over the rows times their scales, held to the torch path (which
    dequantizes and attends in float32). The tolerance: one quantization step of a K/V value
    between paths, and fp8's coarser steps."""
    model = random_model(torch.float32, **shape, max_pos=2048)
    rng = random.Random(4)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            check_quantized_against_torch(model, rng, 16, 60, [(rng.randrange(0, 30), 1) for _ in range(3)] +
                                          [(0, 9), (5, 4), (0, 20), (12, 17)], kv_dtype, tol)
            check_quantized_against_torch(model, rng, 16, 60, [(45, 1)], kv_dtype, tol)
        check_quantized_against_torch(model, rng, 16, 120, [(37, 1), (0, 800)], kv_dtype, tol)
    finally:
        torch.set_num_threads(before)


@needs_ext
@pytest.mark.parametrize("kv_dtype", QUANT)
@pytest.mark.parametrize("D", [8, 16, 64, 128])
def test_det_attention_over_an_8_bit_cache_is_batch_invariant(kv_dtype, D):
    """Deterministic attention over an 8-bit cache: each query's bits are the same alone as in a
    batch, at 1 and 2 threads, on OpenMP and the pool; close to the float64 reference over the
    values the cache holds; and without its scales (or with scales for a float cache) refused."""
    H, Hkv, ps = 6, 2, 16
    g = torch.Generator().manual_seed(D)
    k, ks = quantize_rows(torch.randn(12, ps, Hkv, D, generator=g) * 2, kv_dtype)
    v, vs = quantize_rows(torch.randn(12, ps, Hkv, D, generator=g), kv_dtype)
    table = torch.tensor([[5, 0, 7], [1, 2, 3]], dtype=torch.int32)
    lens, cu = torch.tensor([40, 45], dtype=torch.int32), torch.tensor([0, 1, 6], dtype=torch.int32)
    q = torch.randn(6, H, D, generator=g)
    ext = cpu_ext()
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for pool in (False, True):
                both = ext.det_attention(q, k, v, table, lens, cu, D ** -0.5, pool, ks, vs)
                alone = ext.det_attention(q[:1], k, v, table[:1], lens[:1], cu[:2], D ** -0.5, pool, ks, vs)
                assert torch.equal(both[:1], alone)
                outs.append(both)
        assert all(torch.equal(o, outs[0]) for o in outs)
    finally:
        torch.set_num_threads(before)
    ref = paged_decode_attention_ref(q[:1].double(), dequantize(k, ks, torch.float64),
                                     dequantize(v, vs, torch.float64), table[:1], lens[:1], D ** -0.5)
    torch.testing.assert_close(outs[0][:1].double(), ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="needs k_scale and v_scale"):
        ext.det_attention(q, k, v, table, lens, cu, D ** -0.5)
    with pytest.raises(RuntimeError, match="needs k_scale and v_scale"):
        ext.det_attention(q, k.float(), v.float(), table, lens, cu, D ** -0.5, False, ks, vs)


@needs_ext
@pytest.mark.parametrize("kv_dtype", QUANT)
def test_every_8_bit_value_reads_back_exactly(kv_dtype):
    """Each of the 256 byte values of an 8-bit cache, read by the compiled attention, is the value
    torch gives that byte (subnormal e4m3 values and NaN included): four sequences of one
    token each, whose V row holds 64 of the bytes at scale 1, so each output row is its V row exactly.
    (The AVX2 build widens 16 bytes at a time in registers, fp8 through float16 at 2^-8 with the 2^8
    in the scale; a wrong exponent or a subnormal read as 0 shows here, where the forward's
    tolerance could hide it.)"""
    H, Hkv, D, ps = 2, 1, 64, 16
    v = torch.arange(256, dtype=torch.uint8).view(4, 1, 1, D).view(kv_dtype)
    v = torch.cat([v, torch.zeros(4, ps - 1, 1, D, dtype=torch.uint8).view(kv_dtype)], 1)
    k = torch.zeros_like(v.view(torch.uint8)).view(kv_dtype)
    ones = torch.ones(4, ps, Hkv, 1, dtype=torch.bfloat16)
    table = torch.arange(4, dtype=torch.int32).view(4, 1)
    lens, cu = torch.ones(4, dtype=torch.int32), torch.arange(5, dtype=torch.int32)
    out = cpu_ext().det_attention(torch.randn(4, H, D), k, v, table, lens, cu, D ** -0.5, False, ones, ones)
    want = v[:, 0, 0].float()                                  # (4, D): torch's own conversion
    for h in range(H):
        torch.testing.assert_close(out[:, h], want, rtol=0, atol=0, equal_nan=True)
