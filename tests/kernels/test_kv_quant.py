"""8-bit KV caches (kernels/kv_quant.py): the quantization itself, the Triton write against the torch
one, and both attention kernels over an int8 / fp8 cache against a float64 reference over the
values the cache holds."""
import pytest
import torch

from pagedecode.kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref
from pagedecode.kernels.extend_attention import paged_extend_attention, paged_extend_attention_ref
from pagedecode.kernels.kv_quant import QMAX, dequantize, quantize_rows
from pagedecode.kernels.kv_write import write_kv, write_kv_ref

from .conftest import DEVICE, TOL, interpreting, needs_triton, random_page_tables, rel_err

QUANT_DTYPES = [torch.int8, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_a_row_reads_back_within_its_quantization_step(dtype):
    """int8: every value within half a step (scale / 2) of the original; fp8 e4m3 (3 mantissa
    bits): within 1/16 of the value, or of the smallest normal step; the largest value of each row
    exactly qmax steps; an all-zero row a scale of 0 and zeros, never NaN."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 3, 64, generator=g) * torch.tensor([0.01, 1.0, 300.0])[None, :, None]
    x[2, 1] = 0.0
    q, scale = quantize_rows(x, dtype)
    assert q.dtype == dtype and scale.shape == (7, 3, 1) and scale.dtype == torch.float32
    back = dequantize(q, scale)
    assert scale[2, 1].item() == 0.0 and torch.equal(back[2, 1], torch.zeros(64))
    assert torch.isfinite(back).all()
    err = (back - x).abs()
    if dtype == torch.int8:
        assert (err <= scale / 2 * (1 + 1e-5)).all()
        assert (q.abs().amax(-1) == 127)[scale[..., 0] > 0].all()
    else:
        assert (err <= x.abs() / 16 + scale * 2.0 ** -9).all()
        assert (q.float().abs().amax(-1) == QMAX[dtype])[scale[..., 0] > 0].all()


@needs_triton
@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("page,heads,d", [(16, 2, 64), (8, 5, 128), (4, 3, 8)])
def test_kv_write_quantizes_as_the_reference(dtype, page, heads, d):
    """The Triton write against the torch one: the same scales, and int8 rows bit for bit (the same
    correctly rounded divisions, half-to-even rounding). fp8 rows: bit for bit on the GPU; the
    interpreter rounds ~2 % of float -> e4m3 conversions wrongly (/work/shared/KERNELS.md): a value
    whose rounding carries into the next power of two (124.3 -> 128) comes out half of it (64), so
    there every other value is bit for bit and those only are that. A -1 slot writes nothing: its
    page keeps the poisoned scale."""
    g = torch.Generator().manual_seed(page * heads + d)
    num_pages, T = 6, 11
    slots = torch.randperm(num_pages * page, generator=g)[:T]
    slots[3] = -1
    k = (torch.randn(T, heads, d, generator=g) * 3).to(DEVICE)
    v = torch.randn(T, heads, d, generator=g).to(DEVICE)
    k[5, 0] = 0.0                                                     # an all-zero row
    kc = torch.zeros(num_pages, page, heads, d, dtype=dtype, device=DEVICE)
    vc, kr, vr = kc.clone(), kc.clone(), kc.clone()
    ks = torch.full((num_pages, page, heads, 1), float("nan"), device=DEVICE)
    vs, ksr, vsr = ks.clone(), ks.clone(), ks.clone()
    write_kv(kc, vc, k, v, slots.to(DEVICE), backend="triton", k_scale=ks, v_scale=vs)
    write_kv_ref(kr, vr, k, v, slots.to(DEVICE), ksr, vsr)
    assert torch.equal(ks.isnan(), ksr.isnan()) and int((~ks.isnan()).all(-1).all(-1).sum()) == T - 1
    assert torch.equal(ks.nan_to_num(), ksr.nan_to_num()) and torch.equal(vs.nan_to_num(), vsr.nan_to_num())
    for got, want, scale in ((kc, kr, ks), (vc, vr, vs)):
        if dtype == torch.int8 or not interpreting():
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        else:
            a, b = got.float(), want.float()
            off = a != b
            assert float(off.float().mean()) < 0.05
            assert torch.equal(a[off] * 2, b[off]) and torch.equal(torch.frexp(b[off]).mantissa.abs(),
                                                                   torch.full_like(b[off], 0.5))


def quantized_cache(num_pages, page, hkv, d, dtype, g):
    """Random K and V quantized into an 8-bit paged cache: (kc, vc, ks, vs), and the float64
    values they hold."""
    rows = torch.randn(2, num_pages, page, hkv, d, generator=g) * torch.linspace(0.2, 4.0, d)
    q, s = quantize_rows(rows, dtype)
    held = dequantize(q, s, torch.float64)
    return q[0].to(DEVICE), q[1].to(DEVICE), s[0].to(DEVICE), s[1].to(DEVICE), held[0], held[1]


@needs_triton
@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("hq,hkv,d,page,lens", [(4, 2, 64, 16, [1, 17, 40]), (5, 1, 32, 8, [9, 300])])
def test_attention_over_an_8_bit_cache_is_attention_over_the_values_it_holds(dtype, hq, hkv, d, page, lens):
    """Decode and extend kernels (and the torch references) over an int8 / fp8 cache and its scales
    give, to float32's tolerance, what float64 attention over the dequantized values gives: each row
    is widened and scaled in float32, never attended in 8 bits. 300 tokens: two decode splits."""
    g = torch.Generator().manual_seed(hq * 100 + d + len(lens))
    num_pages = sum(-(-n // page) for n in lens) + 3
    kc, vc, ks, vs, k64, v64 = quantized_cache(num_pages, page, hkv, d, dtype, g)
    table = random_page_tables(lens, page, num_pages, g).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), hq, d, generator=g).to(DEVICE)
    ref = paged_decode_attention_ref(q.double().cpu(), k64, v64, table.cpu(), seq_lens.cpu(), d ** -0.5)
    for backend in ("torch", "triton"):
        for det in (False, True):
            out = paged_decode_attention(q, kc, vc, table, seq_lens, backend=backend, deterministic=det,
                                         k_scale=ks, v_scale=vs)
            assert out.dtype == torch.float32 and rel_err(out.cpu(), ref) < TOL[torch.float32], (backend, det)
    new = [min(n, 9) for n in lens]
    cu = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(new), hq, d, generator=g).to(DEVICE)
    ref = paged_extend_attention_ref(q.double().cpu(), k64, v64, table.cpu(), cu.cpu(), seq_lens.cpu(), d ** -0.5)
    for backend in ("torch", "triton"):
        out = paged_extend_attention(q, kc, vc, table, cu, seq_lens, backend=backend, k_scale=ks, v_scale=vs)
        assert out.dtype == torch.float32 and rel_err(out.cpu(), ref) < TOL[torch.float32], backend
