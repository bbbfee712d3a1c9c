"""The compiled CPU forward's deterministic kernels (csrc/cpu_forward.cpp, det_*): each output the
same bits whatever the number of rows, the chunking of a prompt, or the thread count."""
import pytest
import torch

from pagedecode.model.cpu_forward import cpu_extension_available

pytestmark = pytest.mark.skipif(not cpu_extension_available(), reason="needs the compiled CPU extension")
DTYPES = [torch.float32, torch.bfloat16]


def ext():
    from pagedecode import _cpu
    return _cpu


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [576, 100, 7])           # whole steps, a masked last step, less than one
def test_matmul_rows_are_the_same_bits_for_any_number_of_rows(dtype, k):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(64, k, generator=g).to(dtype)
    w = torch.randn(75, k, generator=g).to(dtype)      # 75 outputs: whole tiles and a remainder
    b = torch.randn(75, generator=g).to(dtype)
    full = ext().det_linear(x, w, b)
    for m in (1, 2, 3, 5, 17, 64):
        for start in (0, 64 - m):
            assert torch.equal(ext().det_linear(x[start:start + m], w, b), full[start:start + m]), (m, start)
    torch.testing.assert_close(full.float(), torch.nn.functional.linear(x.float(), w.float(), b.float()),
                               rtol=2e-2 if dtype == torch.bfloat16 else 1e-4, atol=5e-2 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_and_two_threads_give_the_same_bits(dtype):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(40, 576, generator=g).to(dtype), torch.randn(1536, 576, generator=g).to(dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = (ext().det_linear(x, w), ext().det_rms_norm(x, w[0], 1e-5))
        torch.set_num_threads(2)
        two = (ext().det_linear(x, w), ext().det_rms_norm(x, w[0], 1e-5))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_out,k", [(75, 576), (150, 101), (171, 33), (40, 1536)])
def test_packed_matmul_same_bits_for_rows_threads_and_packing(dtype, n_out, k):
    """csrc/det_matmul.h: M = 1, 3, 17, 64 rows (from the first row and from the last), 1 and 2
    threads, the weight packed once (det_pack, as a model keeps it) or for the call: every output the
    same bits. 150 / 171 outputs: tiles of 2 and 3 panels of 16 beside whole ones of 4; an odd k: the
    bf16 pair kernel's last half pair."""
    g = torch.Generator().manual_seed(n_out)
    x = torch.randn(64, k, generator=g).to(dtype)
    w = torch.randn(n_out, k, generator=g).to(dtype)
    b = torch.randn(n_out, generator=g).to(dtype)
    packed = ext().det_pack(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        full = ext().det_linear(x, w, b)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in (1, 3, 17, 64):
                for start in (0, 64 - m):
                    for pk in (None, packed):
                        got = ext().det_linear(x[start:start + m], w, b, pk)
                        assert torch.equal(got, full[start:start + m]), (threads, m, start, pk is None)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(full.float(), torch.nn.functional.linear(x.float(), w.float(), b.float()),
                               rtol=2e-2 if dtype == torch.bfloat16 else 1e-4, atol=5e-2 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_model_keeps_the_packed_copy_of_the_mode_that_runs(dtype):
    """Deterministic mode swaps oneDNN's packed copies for det_pack's (and back), and the compiled
    forward reading them gives the bits it gives packing every call (pack_weights off)."""
    from .test_cpu_extension import mixed_batch, random_model
    from pagedecode.model.kv_cache import KVCache
    import random
    model = random_model(dtype, heads=4, kv_heads=2, head_dim=64)       # qkv 512 x 256: not a small layer
    model.configure_cpu("onednn", pack_weights=True)    # packing is off by default (one copy of each weight)
    c = model.config
    assert model._compiled.packed_kind in ("onednn", None)
    model.deterministic = True
    assert model._compiled.packed_kind == "det"
    assert torch.equal(model._compiled.layer_slots[0]["qkv_packed"], ext().det_pack(model.layers[0].qkv_w))

    def logits():
        kv = KVCache(c.num_layers, 16, 16, c.num_kv_heads, c.head_dim, dtype)
        batch = mixed_batch(random.Random(0), 16, [[3, 1], [0, 2], [5, 4, 6]], [(7, 1), (0, 20), (10, 30)])
        return model.forward(batch, kv)
    kept = logits()
    model.configure_cpu("onednn", pack_weights=False)
    assert model._compiled.packed_kind is None and model._compiled.layer_slots[0]["qkv_packed"].numel() == 0
    assert torch.equal(logits(), kept)
    model.configure_cpu("onednn", pack_weights=True)
    model.deterministic = False
    from pagedecode.model.cpu_forward import onednn_bf16_supported
    onednn = torch.backends.mkldnn.is_available() and (dtype != torch.bfloat16 or onednn_bf16_supported())
    assert model._compiled.packed_kind == ("onednn" if onednn else None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_rows_alone_and_together(dtype):
    x = torch.randn(33, 100).to(dtype)
    w = torch.rand(100).to(dtype)
    full = ext().det_rms_norm(x, w, 1e-5)
    assert all(torch.equal(ext().det_rms_norm(x[i:i + 1], w, 1e-5)[0], full[i]) for i in range(33))
    ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype).float() * w.float()
    torch.testing.assert_close(full.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_gives_the_same_bits_at_every_thread_count(dtype):
    """A lone sequence's query heads split over the threads; under 8 rows of a quantized model
    (pool=True) the items run on the spinning pool, a worker computing into its scratch, copied
    out: one decode row, three, and a 5-row chunk beside a decode row give the same bits at 1 to 4
    threads, on OpenMP or the pool, call after call."""
    H, Hkv, D, ps = 9, 3, 64, 16
    g = torch.Generator().manual_seed(4)
    k = torch.randn(12, ps, Hkv, D, generator=g).to(dtype)
    v = torch.randn(12, ps, Hkv, D, generator=g).to(dtype)
    table = torch.tensor([[5, 0, 7], [1, 2, 3], [11, 9, 4]], dtype=torch.int32)
    layouts = [([40], [0, 1]), ([40, 3, 33], [0, 1, 2, 3]), ([45, 17], [0, 5, 6])]
    before = torch.get_num_threads()
    try:
        for lens, cu in layouts:
            S = len(lens)
            q = torch.randn(cu[-1], H, D, generator=g).to(dtype)
            args = (k, v, table[:S].contiguous(), torch.tensor(lens, dtype=torch.int32),
                    torch.tensor(cu, dtype=torch.int32), D ** -0.5)
            outs = []
            for threads in (1, 2, 3, 4):
                torch.set_num_threads(threads)
                outs += [ext().det_attention(q, *args, pool=pool) for pool in (False, True) for _ in range(10)]
            assert all(torch.equal(outs[0], o) for o in outs[1:]), (lens, cu)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_attention_over_a_16_bit_cache_is_attention_over_its_float32_values(cache_dtype):
    """kv_cache_dtype: a float32 model's queries against a float16 / bfloat16 cache give the same
    bits as against that cache widened to float32 (widening is exact, the arithmetic after it the
    same), at 1 and 2 threads, on OpenMP and the pool; and a float32 cache is refused for bfloat16
    queries by name."""
    H, Hkv, D, ps = 9, 3, 64, 16
    g = torch.Generator().manual_seed(6)
    k = torch.randn(12, ps, Hkv, D, generator=g).to(cache_dtype)
    v = torch.randn(12, ps, Hkv, D, generator=g).to(cache_dtype)
    table = torch.tensor([[5, 0, 7], [1, 2, 3]], dtype=torch.int32)
    q = torch.randn(6, H, D, generator=g)
    args = (table, torch.tensor([40, 45], dtype=torch.int32), torch.tensor([0, 1, 6], dtype=torch.int32), D ** -0.5)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for pool in (False, True):
                got = ext().det_attention(q, k, v, *args, pool=pool)
                assert torch.equal(got, ext().det_attention(q, k.float(), v.float(), *args, pool=pool))
    finally:
        torch.set_num_threads(before)
    with pytest.raises(RuntimeError, match="bfloat16 model's KV cache must be bfloat16"):
        ext().det_attention(q.bfloat16(), k.float(), v.float(), *args)


def test_attention_refuses_tables_outside_the_cache():
    """det_attention checks the layout every work item relies on, and names what is wrong (an
    item given one it does not hold computes nothing: the output would be left unwritten)."""
    k = torch.zeros(4, 16, 1, 64)
    q = torch.zeros(2, 2, 64)

    def attend(table, lens, cu):
        return ext().det_attention(q, k, k, torch.tensor(table, dtype=torch.int32),
                                   torch.tensor(lens, dtype=torch.int32), torch.tensor(cu, dtype=torch.int32),
                                   0.125, pool=True)
    assert attend([[0, 1], [2, 3]], [20, 17], [0, 1, 2]).shape == (2, 2, 64)
    with pytest.raises(RuntimeError, match="page 1 is 4, outside the cache"):
        attend([[0, 1], [2, 4]], [20, 17], [0, 1, 2])
    with pytest.raises(RuntimeError, match="page 1 is -1"):
        attend([[0, -1], [2, 3]], [20, 17], [0, 1, 2])
    with pytest.raises(RuntimeError, match="fit its pages"):
        attend([[0, 1], [2, 3]], [40, 17], [0, 1, 2])
    with pytest.raises(RuntimeError, match="cu_q must run from 0"):
        attend([[0, 1], [2, 3]], [20, 17], [0, 1, 1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_decode_extend_and_chunked_give_the_same_bits(dtype):
    """A 45-token sequence (pages out of order) attended as one prefill, as chunks of 16 / 29 / 1
    rows, and row by row as decode steps: each query position the same bits."""
    H, Hkv, D, ps, n = 6, 2, 64, 16, 45
    g = torch.Generator().manual_seed(3)
    k = torch.randn(8, ps, Hkv, D, generator=g).to(dtype)
    v = torch.randn(8, ps, Hkv, D, generator=g).to(dtype)
    q = torch.randn(n, H, D, generator=g).to(dtype)
    table = torch.tensor([[5, 0, 7]], dtype=torch.int32)

    def attend(lo, hi, others=0):
        """rows lo .. hi of the sequence (cached lo), behind `others` one-token decode rows"""
        lens = torch.tensor([3] * others + [hi], dtype=torch.int32)
        cu = torch.tensor(list(range(others + 1)) + [others + hi - lo], dtype=torch.int32)
        tab = torch.cat([torch.tensor([[1, 2, 3]] * others, dtype=torch.int32), table]) if others else table
        qs = torch.cat([torch.randn(others, H, D).to(dtype), q[lo:hi]])
        return ext().det_attention(qs, k, v, tab, lens, cu, D ** -0.5)[others:]
    whole = attend(0, n)
    chunked = torch.cat([attend(0, 16), attend(16, 45, others=3)])
    stepped = torch.cat([attend(i, i + 1, others=i % 4) for i in range(n)])
    assert torch.equal(whole, chunked) and torch.equal(whole, stepped)


def attention_reference(q, k, v, table, lens, cu, scale):
    """Causal attention over the pages in float64: row i of sequence s sees positions 0 .. cached + i."""
    H, D = q.shape[1], q.shape[2]
    Hkv, ps = k.shape[2], k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for s in range(len(lens)):
        n = int(lens[s])
        rows = torch.arange(n)
        keys = k[table[s][rows // ps].long(), rows % ps].double().repeat_interleave(H // Hkv, 1)  # (n, H, D)
        vals = v[table[s][rows // ps].long(), rows % ps].double().repeat_interleave(H // Hkv, 1)
        first, last = int(cu[s]), int(cu[s + 1])
        cached = n - (last - first)
        for i in range(first, last):
            see = cached + (i - first) + 1
            w = torch.softmax(torch.einsum("hd,nhd->hn", q[i].double(), keys[:see]) * scale, dim=-1)
            out[i] = torch.einsum("hn,nhd->hd", w, vals[:see])
    return out


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 32), (8, 1, 64), (12, 2, 128), (7, 7, 64),
                                                     (10, 2, 16), (6, 2, 24)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_attention_reads_each_kv_head_once_for_its_query_heads(heads, kv_heads, head_dim, cache_dtype):
    """The query heads of a row that share a kv head read each key / value row once, in groups of
    up to 3 (qk_group / pv_group in csrc/paged_attention.h): every head layout (1 to 8 query heads per
    kv head, groups of 3 + 1, 3 + 3, 3 + 2, 3 + 3 + 2; head sizes of whole vectors, and 24, which
    takes the per-head path), decode rows, chunks and a lone row whose heads split over the threads
    at a group's middle: float64 attention to float32's rounding, the same bits at 1 to 4 threads."""
    g = torch.Generator().manual_seed(heads * 1000 + head_dim)
    ps = 16
    k = torch.randn(24, ps, kv_heads, head_dim, generator=g).to(cache_dtype)
    v = torch.randn(24, ps, kv_heads, head_dim, generator=g).to(cache_dtype)
    table = torch.stack([torch.randperm(24, generator=g)[:8] for _ in range(4)]).to(torch.int32)
    layouts = [([45], [0, 1]),                                  # a lone decode row: heads split per thread
               ([70, 3, 33, 100], [0, 1, 2, 12, 13]),           # decode rows and a 10-row chunk
               ([16, 127], [0, 16, 29])]                        # a whole page's prompt; a chunk after a prefix
    before = torch.get_num_threads()
    try:
        for lens, cu in layouts:
            S = len(lens)
            q = torch.randn(cu[-1], heads, head_dim, generator=g)
            args = (k, v, table[:S].contiguous(), torch.tensor(lens, dtype=torch.int32),
                    torch.tensor(cu, dtype=torch.int32), head_dim ** -0.5)
            want = attention_reference(q, *args)
            outs = []
            for threads in (1, 2, 3, 4):
                torch.set_num_threads(threads)
                outs += [ext().det_attention(q, *args, pool=pool) for pool in (False, True)]
            torch.testing.assert_close(outs[0].double(), want, rtol=1e-5, atol=1e-5)
            assert all(torch.equal(outs[0], o) for o in outs[1:]), (lens, cu)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_last_layer_runs_for_the_logits_rows_alone_with_the_same_bits(dtype):
    """When only each sequence's last row needs logits (prefill chunks, decode rows), the last
    layer's attention, o_proj and MLP run for those rows alone (last_rows_only): in deterministic
    mode their logits are the bits of the forward that keeps every row (all rows' logits asked
    for), and every row's K/V is written alike. Rows that are not last rows (a middle one) take the
    full layer and agree with it too, as does a strided view of the indices (read by value)."""
    from .test_cpu_extension import mixed_batch, random_model
    from pagedecode.model.kv_cache import KVCache
    import dataclasses
    import random
    model = random_model(dtype, heads=4, kv_heads=2, head_dim=64)
    c = model.config
    model.deterministic = True
    try:
        batch = mixed_batch(random.Random(0), 16, [[3, 1], [0, 2], [5, 4, 6], [7, 8]], [(7, 1), (0, 20), (10, 30), (0, 5)])
        rows = int(batch.cu_q[-1])

        def forward(logits_rows):
            kv = KVCache(c.num_layers, 16, 16, c.num_kv_heads, c.head_dim, dtype)
            b = dataclasses.replace(batch, logits_indices=torch.tensor(logits_rows))
            return model.forward(b, kv), kv
        last = batch.logits_indices.tolist()
        assert last == [0, 20, 50, 55] and rows == 56
        trimmed, kv_trimmed = forward(last)
        full, kv_full = forward(list(range(rows)))
        assert torch.equal(trimmed, full[last])
        assert torch.equal(kv_trimmed.k, kv_full.k) and torch.equal(kv_trimmed.v, kv_full.v)
        middle, _ = forward([0, 12, 50])                     # row 12 is not its sequence's last
        assert torch.equal(middle, full[[0, 12, 50]])
        # a strided view is read as its values, not as the memory under it (which holds the last rows)
        strided = torch.tensor([0, 20, 50, 55, 20, 1, 50, 1])[::2]
        kv = KVCache(c.num_layers, 16, 16, c.num_kv_heads, c.head_dim, dtype)
        assert torch.equal(model.forward(dataclasses.replace(batch, logits_indices=strided), kv), full[[0, 50, 20, 50]])
    finally:
        model.deterministic = False
