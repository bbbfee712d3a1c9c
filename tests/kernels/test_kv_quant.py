"""8-bit KV caches (kernels/kv_quant.py): the quantization itself, the Triton write against the torch
one, and both attention kernels over an int8 / fp8 cache against a float64 reference over the
values the cache holds."""
import pytest
import torch

from pagedecode.kernels.attention_ref import paged_decode_attention_ref
from pagedecode.kernels.decode_attention import paged_decode_attention
from pagedecode.kernels.extend_attention import paged_extend_attention, paged_extend_attention_ref
from pagedecode.kernels.kv_quant import FP8_STEPS, QMAX, SCALE_DTYPE, dequantize, e4m3_round, quantize_rows, stored_scale
from pagedecode.kernels.kv_write import write_kv, write_kv_ref

from .conftest import DEVICE, TOL, needs_triton, random_page_tables, rel_err

QUANT_DTYPES = [torch.int8, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_a_row_reads_back_within_its_quantization_step(dtype):
    """int8: every value within half a step (scale / 2) of the original, the largest value of each
    row exactly 127 steps; fp8 e4m3 (3 mantissa bits): within 1/16 of the value, or of the
    smallest normal step, the scale amax / 448 times 1 + j / 16 for some j, as bfloat16 stores
    it; an all-zero row a scale of 0 and zeros, never NaN. Scales are bfloat16 (2 bytes a row)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 3, 64, generator=g) * torch.tensor([0.01, 1.0, 300.0])[None, :, None]
    x[2, 1] = 0.0
    q, scale = quantize_rows(x, dtype)
    assert q.dtype == dtype and scale.shape == (7, 3, 1) and scale.dtype == torch.bfloat16
    back = dequantize(q, scale)
    scale = scale.float()
    assert scale[2, 1].item() == 0.0 and torch.equal(back[2, 1], torch.zeros(64))
    assert torch.isfinite(back).all()
    err = (back - x).abs()
    if dtype == torch.int8:
        assert (err <= scale / 2 * (1 + 1e-5)).all()
        assert (q.abs().amax(-1) == 127)[scale[..., 0] > 0].all()
    else:
        assert (err <= x.abs() / 16 + scale * 2.0 ** -9).all()
        base = x.abs().amax(-1, keepdim=True) / QMAX[dtype]
        steps = torch.stack([stored_scale(base * (1 + j / FP8_STEPS)) for j in range(FP8_STEPS)])
        assert (steps == scale).any(0).all()
        assert len(torch.unique(scale / base)) > 3                    # the search picks varied scales


def test_e4m3_rounding_is_torchs_conversion():
    """kv_quant.e4m3_round (the arithmetic every path rounds with) against torch's float -> e4m3
    conversion over magnitudes from e4m3's subnormals to its largest value, ties included."""
    g = torch.Generator().manual_seed(3)
    y = (torch.randn(100_000, generator=g) * torch.logspace(-4, 2.3, 100_000)).clamp(-448, 448)
    ties = torch.tensor([2.0 ** -10, 3 * 2.0 ** -10, 1.0625, 1.1875, 15.5, 232.0, 440.0, 448.0, -448.0])
    y = torch.cat([y, ties, -ties])
    assert torch.equal(e4m3_round(y), y.to(torch.float8_e4m3fn).float())


def test_the_fp8_scale_search_beats_the_largest_value_at_448():
    """The searched scale's rows read back with less squared error than amax / 448's (as bfloat16
    stores it) on every row (it is one of the candidates) and clearly less over many."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(512, 64, generator=g) * torch.linspace(0.1, 5.0, 64)
    q, s = quantize_rows(x, torch.float8_e4m3fn)
    plain = stored_scale(x.abs().amax(-1, keepdim=True) / 448)
    err = ((dequantize(q, s) - x) ** 2).sum(-1)
    err_plain = (((x / plain).clamp(-448, 448).to(torch.float8_e4m3fn).float() * plain - x) ** 2).sum(-1)
    assert (err <= err_plain * (1 + 1e-6)).all() and err.sum() < 0.8 * err_plain.sum()


@needs_triton
@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("page,heads,d", [(16, 2, 64), (8, 5, 128), (4, 3, 8)])
def test_kv_write_quantizes_as_the_reference(dtype, page, heads, d):
    """The Triton write against the torch one: the same scales and rows bit for bit (the same
    correctly rounded divisions, half-to-even rounding; fp8's rounding done in float32 arithmetic
    by both, so the interpreter's wrong float -> e4m3 conversions (/work/shared/KERNELS.md) never
    see an inexact value, and both pick the same scale). A -1 slot writes nothing: its page keeps
    the poisoned scale."""
    g = torch.Generator().manual_seed(page * heads + d)
    num_pages, T = 6, 11
    slots = torch.randperm(num_pages * page, generator=g)[:T]
    slots[3] = -1
    k = (torch.randn(T, heads, d, generator=g) * 3).to(DEVICE)
    v = torch.randn(T, heads, d, generator=g).to(DEVICE)
    k[5, 0] = 0.0                                                     # an all-zero row
    kc = torch.zeros(num_pages, page, heads, d, dtype=dtype, device=DEVICE)
    vc, kr, vr = kc.clone(), kc.clone(), kc.clone()
    ks = torch.full((num_pages, page, heads, 1), float("nan"), dtype=SCALE_DTYPE, device=DEVICE)
    vs, ksr, vsr = ks.clone(), ks.clone(), ks.clone()
    write_kv(kc, vc, k, v, slots.to(DEVICE), backend="triton", k_scale=ks, v_scale=vs)
    write_kv_ref(kr, vr, k, v, slots.to(DEVICE), ksr, vsr)
    assert torch.equal(ks.isnan(), ksr.isnan()) and int((~ks.isnan()).all(-1).all(-1).sum()) == T - 1
    assert torch.equal(ks.nan_to_num(), ksr.nan_to_num()) and torch.equal(vs.nan_to_num(), vsr.nan_to_num())
    for got, want in ((kc, kr), (vc, vr)):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


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


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_a_scale_is_the_bfloat16_value_its_row_was_quantized_against(dtype):
    """The stored bfloat16 scale is the one the row was divided by: rows whose float32 scale
    amax / qmax is not a bfloat16 value read back within their step of the stored value (int8's
    largest value still 127 steps), over magnitudes from 1e-30 to 1e30 (float32's range: no scale
    overflows or flushes to zero)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(61, 2, 32, generator=g) * torch.logspace(-30, 30, 61)[:, None, None]
    q, scale = quantize_rows(x, dtype)
    assert scale.dtype == SCALE_DTYPE == torch.bfloat16 and (scale > 0).all() and torch.isfinite(scale).all()
    s = scale.float()
    raw = x.abs().amax(-1, keepdim=True) / QMAX[dtype]
    err = (dequantize(q, scale) - x).abs()
    if dtype == torch.int8:
        assert (s != raw).float().mean() > 0.9                        # rounded nearly all
        assert ((s - raw).abs() <= raw * 2.0 ** -8).all()             # to nearest (8 significant bits)
        assert (err <= s / 2 * (1 + 1e-5)).all() and (q.abs().amax(-1) == 127).all()
    else:
        candidates = torch.stack([stored_scale(raw * (1 + j / FP8_STEPS)) for j in range(FP8_STEPS)])
        assert (candidates == s).any(0).all()
        assert (err <= x.abs() / 16 + s * 2.0 ** -9).all()
