"""Paged decode and extend attention: Triton (interpreter on CPU) vs a float64 reference."""
import zlib

import pytest
import torch

from pagedecode.kernels.attention_ref import paged_decode_attention_ref
from pagedecode.kernels.decode_attention import paged_decode_attention
from pagedecode.kernels.extend_attention import paged_extend_attention, paged_extend_attention_ref

from .conftest import DEVICE, TOL, needs_triton, random_page_tables, rel_err


def stable_seed(*parts) -> int:
    """The same seed in every process (str hash() is salted per process)."""
    return zlib.crc32(repr(parts).encode())

# (q_heads, kv_heads, head_dim, page_size, seq_lens): edges the issue names, sized for the
# interpreter (~1-2 s per case): length 1, page +-1, split boundary 256 +-1, GQA 1/2/4/5/8
DECODE_CASES = [
    (2, 2, 64, 16, [1, 15, 16, 17]),          # GQA 1, page -1/page/page+1
    (4, 2, 128, 16, [1, 33]),                 # GQA 2, d128
    (8, 2, 64, 8, [7, 9]),                    # GQA 4, page 8
    (5, 1, 64, 32, [31, 257]),                # GQA 5, a split of one token past 256
    (8, 1, 64, 128, [256, 129]),              # GQA 8, page 128, exactly one split
    (2, 1, 64, 64, [255, 1]),                 # mixed lengths, ragged
]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d,page,lens", DECODE_CASES)
def test_decode_matches_reference(hq, hkv, d, page, lens, dtype):
    g = torch.Generator().manual_seed(stable_seed(hq, hkv, d, page, tuple(lens), dtype))
    num_pages = sum(-(-n // page) for n in lens) + 3
    kc = torch.randn(num_pages, page, hkv, d, generator=g).to(dtype).to(DEVICE)
    vc = torch.randn(num_pages, page, hkv, d, generator=g).to(dtype).to(DEVICE)
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype).to(DEVICE)
    table = random_page_tables(lens, page, num_pages, g).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(q, kc, vc, table, seq_lens, backend="triton")
    ref = paged_decode_attention_ref(q.double(), kc.double(), vc.double(), table, seq_lens, d ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.isfinite(out.float()).all()
    assert rel_err(out, ref) < TOL[dtype]
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype] * 4, rtol=TOL[dtype])


@needs_triton
def test_decode_result_does_not_depend_on_the_batch():
    """Deterministic mode's fixed split size: a sequence gets bit-identical output alone or
    beside a long one."""
    g = torch.Generator().manual_seed(7)
    kc = torch.randn(48, 16, 1, 64, generator=g).to(DEVICE)
    vc = torch.randn(48, 16, 1, 64, generator=g).to(DEVICE)
    q = torch.randn(2, 4, 64, generator=g).to(DEVICE)
    table = random_page_tables([100, 600], 16, 48, g).to(DEVICE)
    lens = torch.tensor([100, 600], dtype=torch.int32, device=DEVICE)
    both = paged_decode_attention(q, kc, vc, table, lens, backend="triton", deterministic=True)
    alone = paged_decode_attention(q[:1], kc, vc, table[:1], lens[:1], backend="triton", deterministic=True)
    assert torch.equal(both[0], alone[0])


# (q_heads, kv_heads, head_dim, page, [(prefix, new)]): prefix 0, decode rows (new 1), page edges
EXTEND_CASES = [
    (2, 2, 64, 16, [(0, 17), (16, 1), (5, 11)]),
    (5, 1, 64, 8, [(0, 9), (7, 3)]),
    (8, 2, 128, 16, [(33, 16), (0, 1)]),
    (4, 1, 64, 32, [(0, 40)]),
]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d,page,spans", EXTEND_CASES)
def test_extend_matches_reference(hq, hkv, d, page, spans, dtype):
    g = torch.Generator().manual_seed(stable_seed(hq, hkv, d, page, tuple(spans), dtype))
    lens = [p + n for p, n in spans]
    num_pages = sum(-(-n // page) for n in lens) + 2
    kc = torch.randn(num_pages, page, hkv, d, generator=g).to(dtype).to(DEVICE)
    vc = torch.randn(num_pages, page, hkv, d, generator=g).to(dtype).to(DEVICE)
    cu = torch.tensor([0] + list(torch.tensor([n for _, n in spans]).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hq, d, generator=g).to(dtype).to(DEVICE)
    table = random_page_tables(lens, page, num_pages, g).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    cu = cu.to(DEVICE)
    out = paged_extend_attention(q, kc, vc, table, cu, seq_lens, backend="triton")
    ref = paged_extend_attention_ref(q.double(), kc.double(), vc.double(), table, cu, seq_lens, d ** -0.5)
    assert torch.isfinite(out.float()).all()
    assert rel_err(out, ref) < TOL[dtype]


@needs_triton
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_cache_under_float32_queries(cache_dtype):
    """kv_cache_dtype: a float32 model over a float16 / bfloat16 cache. Both kernels widen each
    loaded K/V row to float32, so they match the float64 reference over the same rounded cache to
    float32's tolerance, not the cache's."""
    g = torch.Generator().manual_seed(stable_seed("16-bit cache", cache_dtype))
    page, lens, spans = 16, [1, 17, 40], [(0, 9), (16, 1), (5, 11)]
    num_pages = 12
    kc = torch.randn(num_pages, page, 2, 64, generator=g).to(cache_dtype).to(DEVICE)
    vc = torch.randn(num_pages, page, 2, 64, generator=g).to(cache_dtype).to(DEVICE)
    table = random_page_tables(lens, page, num_pages, g).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), 4, 64, generator=g).to(DEVICE)
    out = paged_decode_attention(q, kc, vc, table, seq_lens, backend="triton")
    ref = paged_decode_attention_ref(q.double(), kc.double(), vc.double(), table, seq_lens, 64 ** -0.5)
    assert out.dtype == torch.float32 and rel_err(out, ref) < TOL[torch.float32]
    ext_lens = [p + n for p, n in spans]
    table = random_page_tables(ext_lens, page, num_pages, g).to(DEVICE)
    cu = torch.tensor([0, 9, 10, 21], dtype=torch.int32, device=DEVICE)
    q = torch.randn(21, 4, 64, generator=g).to(DEVICE)
    seq_lens = torch.tensor(ext_lens, dtype=torch.int32, device=DEVICE)
    out = paged_extend_attention(q, kc, vc, table, cu, seq_lens, backend="triton")
    ref = paged_extend_attention_ref(q.double(), kc.double(), vc.double(), table, cu, seq_lens, 64 ** -0.5)
    assert out.dtype == torch.float32 and rel_err(out, ref) < TOL[torch.float32]


def test_extend_reference_agrees_with_dense_causal_attention():
    """The reference itself, against torch's SDPA on a contiguous copy (prefix 0)."""
    g = torch.Generator().manual_seed(3)
    n, hq, hkv, d, page = 21, 4, 2, 16, 8
    k = torch.randn(n, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(n, hkv, d, generator=g, dtype=torch.float64)
    q = torch.randn(n, hq, d, generator=g, dtype=torch.float64)
    table = random_page_tables([n], page, 6, g)
    kc = torch.zeros(6, page, hkv, d, dtype=torch.float64)
    vc = torch.zeros_like(kc)
    for pos in range(n):
        kc[table[0, pos // page], pos % page] = k[pos]
        vc[table[0, pos // page], pos % page] = v[pos]
    out = paged_extend_attention_ref(q, kc, vc, table, torch.tensor([0, n]), torch.tensor([n]), d ** -0.5)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1),
        is_causal=True).transpose(0, 1)
    torch.testing.assert_close(out, dense)
    dec = paged_decode_attention_ref(q[-1:], kc, vc, table, torch.tensor([n]), d ** -0.5)
    torch.testing.assert_close(dec[0], dense[-1])


@needs_triton
@pytest.mark.parametrize("hq,hkv,d,page,lens", [(6, 1, 80, 8, [5, 70]), (12, 2, 96, 16, [33, 1])])
def test_odd_head_dims_and_int64_metadata(hq, hkv, d, page, lens):
    """Head dims that are not powers of two (masked lanes) and int64 page tables / lengths."""
    g = torch.Generator().manual_seed(d)
    num_pages = sum(-(-n // page) for n in lens) + 2
    kc = torch.randn(num_pages, page, hkv, d, generator=g).to(DEVICE)
    vc = torch.randn(num_pages, page, hkv, d, generator=g).to(DEVICE)
    table = random_page_tables(lens, page, num_pages, g).long().to(DEVICE)
    seq_lens = torch.tensor(lens, device=DEVICE)
    q = torch.randn(len(lens), hq, d, generator=g).to(DEVICE)
    out = paged_decode_attention(q, kc, vc, table, seq_lens, backend="triton")
    ref = paged_decode_attention_ref(q.double(), kc.double(), vc.double(), table, seq_lens, d ** -0.5)
    assert rel_err(out, ref) < TOL[torch.float32]
    cu = torch.tensor([0, 3, 4], device=DEVICE)
    qe = torch.randn(4, hq, d, generator=g).to(DEVICE)
    out = paged_extend_attention(qe, kc, vc, table, cu, seq_lens, backend="triton")
    ref = paged_extend_attention_ref(qe.double(), kc.double(), vc.double(), table, cu, seq_lens, d ** -0.5)
    assert rel_err(out, ref) < TOL[torch.float32]


def poison_outside(cache, table, lens, page):
    """NaN in every slot no sequence owns: unused pages and the tails of last pages."""
    owned = torch.zeros(cache.shape[0] * page, dtype=torch.bool)
    for row, n in zip(table.tolist(), lens):
        for p in range(n):
            owned[row[p // page] * page + p % page] = True
    flat = cache.view(-1, *cache.shape[2:])
    flat[~owned.to(cache.device)] = float("nan")


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=needs_triton), "torch"])
def test_nan_outside_the_sequences_never_reaches_attention(backend):
    """Every backend: free pages and unwritten page tails may hold anything (NaN included)."""
    g = torch.Generator().manual_seed(11)
    lens, page, hq, hkv, d = [5, 13, 1], 4, 4, 2, 64
    kc = torch.randn(12, page, hkv, d, generator=g).to(DEVICE)
    vc = torch.randn(12, page, hkv, d, generator=g).to(DEVICE)
    q = torch.randn(len(lens), hq, d, generator=g).to(DEVICE)
    table = random_page_tables(lens, page, 12, g).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    clean = paged_decode_attention(q, kc, vc, table, seq_lens, backend=backend)
    cu = torch.tensor([0, 2, 5, 6], dtype=torch.int32, device=DEVICE)       # 2, 3 and 1 new tokens
    qx = torch.randn(6, hq, d, generator=g).to(DEVICE)
    clean_x = paged_extend_attention(qx, kc, vc, table, cu, seq_lens, d ** -0.5, backend=backend)
    poison_outside(kc, table, lens, page)
    poison_outside(vc, table, lens, page)
    assert torch.equal(paged_decode_attention(q, kc, vc, table, seq_lens, backend=backend), clean)
    assert torch.equal(paged_extend_attention(qx, kc, vc, table, cu, seq_lens, d ** -0.5, backend=backend), clean_x)
