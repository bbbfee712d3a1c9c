"""Deterministic mode's Triton kernels (issue 22, the GPU path), in the interpreter on CPU: a
query's attention output is the same bits from decode, extend and chunked extend; the matmul and
RMSNorm give row i the same bits whatever the row count. Compiled for sm_90 in compile_hopper.py;
run compiled on the GPU by benchmarks/device_check.sh's tests step."""
import pytest
import torch

from pagedecode.kernels.decode_attention import paged_decode_attention
from pagedecode.kernels.extend_attention import paged_extend_attention, paged_extend_attention_ref
from pagedecode.kernels.matmul import deterministic_linear, matmul_ref
from pagedecode.kernels.quant_matmul import dequantize_blocks, quant_matmul_deterministic, random_blocks
from pagedecode.kernels.rmsnorm import rms_norm, rms_norm_deterministic

from .conftest import DEVICE, TOL, needs_row_invariant_dot, needs_triton, random_page_tables, rel_err
from .test_attention import stable_seed

pytestmark = needs_triton


def packed(spans):
    """cu_q and seq_lens (int32, on DEVICE) for sequences given as (prefix, new) spans."""
    cu = [0]
    for _, n in spans:
        cu.append(cu[-1] + n)
    lens = [p + n for p, n in spans]
    return (torch.tensor(cu, dtype=torch.int32, device=DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE))


# (q_heads, kv_heads, head_dim, page, [(prefix, new)], where the chunked call cuts each sequence's new
# tokens): a plain prefill, a prefix-cached chunk across the 256-token split boundary (positions
# 252..257: queries whose context spans two splits beside ones whose context does not), a one-token
# extend (as verification of one draft), GQA 3 (a padded head group), head dim 80 (masked lanes)
CASES = [
    (4, 1, 64, 16, [(0, 9), (252, 6), (9, 1)], [4, 3, 0]),
    (6, 2, 80, 8, [(3, 6), (0, 2)], [5, 1]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d,page,spans,cuts", CASES)
def test_decode_extend_and_chunked_extend_give_the_same_bits(hq, hkv, d, page, spans, cuts, dtype):
    g = torch.Generator().manual_seed(stable_seed("det-attn", hq, hkv, d, page, tuple(spans), dtype))
    lens = [p + n for p, n in spans]
    num_pages = sum(-(-n // page) for n in lens) + 2
    kc = torch.randn(num_pages, page, hkv, d, generator=g).to(dtype).to(DEVICE)
    vc = torch.randn(num_pages, page, hkv, d, generator=g).to(dtype).to(DEVICE)
    table = random_page_tables(lens, page, num_pages, g).to(DEVICE)
    T = sum(n for _, n in spans)
    q = torch.randn(T, hq, d, generator=g).to(dtype).to(DEVICE)
    cu, seq_lens = packed(spans)

    # one extend call over every sequence's new tokens
    whole = paged_extend_attention(q, kc, vc, table, cu, seq_lens, backend="triton", deterministic=True)
    ref = paged_extend_attention_ref(q.double(), kc.double(), vc.double(), table, cu, seq_lens, d ** -0.5)
    assert torch.isfinite(whole.float()).all()
    assert rel_err(whole, ref) < TOL[dtype]

    # the same tokens in two chunked calls: first `cut` new tokens of each sequence, then the rest
    # (in the second call the first chunk is the cached prefix)
    first = [(p, c) for (p, _), c in zip(spans, cuts)]
    rest = [(p + c, n - c) for (p, n), c in zip(spans, cuts)]
    rows = [(s, i) for s, (_, n) in enumerate(spans) for i in range(n)]        # (sequence, new index)
    idx_first = [r for r, (s, i) in enumerate(rows) if i < cuts[s]]
    idx_rest = [r for r, (s, i) in enumerate(rows) if i >= cuts[s]]
    chunked = torch.full_like(whole, float("nan"))
    for part, idx in ((first, idx_first), (rest, idx_rest)):
        pcu, plens = packed(part)
        sel = torch.tensor(idx, dtype=torch.long, device=DEVICE)
        chunked[sel] = paged_extend_attention(q[sel], kc, vc, table, pcu, plens, backend="triton",
                                              deterministic=True)

    # every token as a decode query, all in one batch in a shuffled order beside one another
    order = torch.randperm(T, generator=g)
    seq_of = torch.tensor([s for s, _ in rows])[order]
    pos_of = torch.tensor([spans[s][0] + i for s, i in rows])[order]
    dec = paged_decode_attention(q[order.to(DEVICE)], kc, vc, table[seq_of.to(DEVICE)],
                                 (pos_of + 1).to(torch.int32).to(DEVICE), backend="triton", deterministic=True)
    decoded = torch.empty_like(whole)
    decoded[order.to(DEVICE)] = dec

    for r in range(T):
        assert torch.equal(whole[r], chunked[r]), f"row {rows[r]}: extend vs chunked extend"
        assert torch.equal(whole[r], decoded[r]), f"row {rows[r]}: extend vs decode"


def test_deterministic_extend_in_several_launches_gives_the_same_bits(monkeypatch):
    """Long prefills go through the decode kernel in slices of tokens (its float32 partials
    bounded per launch): slicing changes no bits."""
    import pagedecode.kernels.extend_attention as EA
    g = torch.Generator().manual_seed(9)
    page, hq, hkv, d, spans = 8, 2, 1, 32, [(0, 7), (4, 3)]
    lens = [p + n for p, n in spans]
    kc = torch.randn(6, page, hkv, d, generator=g).to(DEVICE)
    vc = torch.randn(6, page, hkv, d, generator=g).to(DEVICE)
    table = random_page_tables(lens, page, 6, g).to(DEVICE)
    q = torch.randn(10, hq, d, generator=g).to(DEVICE)
    cu, seq_lens = packed(spans)
    whole = paged_extend_attention(q, kc, vc, table, cu, seq_lens, backend="triton", deterministic=True)
    monkeypatch.setattr(EA, "DETERMINISTIC_PARTIALS_BYTES", 3 * hq * d * 4)      # 3 tokens a launch
    sliced = paged_extend_attention(q, kc, vc, table, cu, seq_lens, backend="triton", deterministic=True)
    assert torch.equal(whole, sliced)


def test_deterministic_extend_differs_from_the_default_only_in_order():
    """The default kernel (one pass over the context per block of tokens) is kept for the default
    mode; across the 256 split it sums in another order, so the bits may differ but not the value."""
    g = torch.Generator().manual_seed(5)
    page, hq, hkv, d, spans = 16, 2, 1, 64, [(255, 3)]
    kc = torch.randn(18, page, hkv, d, generator=g).to(DEVICE)
    vc = torch.randn(18, page, hkv, d, generator=g).to(DEVICE)
    table = random_page_tables([258], page, 18, g).to(DEVICE)
    q = torch.randn(3, hq, d, generator=g).to(DEVICE)
    cu, lens = packed(spans)
    det = paged_extend_attention(q, kc, vc, table, cu, lens, backend="triton", deterministic=True)
    default = paged_extend_attention(q, kc, vc, table, cu, lens, backend="triton")
    torch.testing.assert_close(det, default, atol=1e-5, rtol=1e-5)
    empty = paged_extend_attention(q[:0], kc, vc, table[:0], torch.zeros(1, dtype=torch.int32, device=DEVICE),
                                   lens[:0], backend="triton", deterministic=True)
    assert empty.shape == (0, hq, d)


ROW_COUNTS = (1, 3, 17, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_matmul_rows_are_the_same_bits_for_every_row_count(dtype, bias):
    """Row i of a 64-row product equals the same row computed in calls of 1, 3 and 17 rows, taken
    from the start, the end and the middle of the 64: K = 83 is not a multiple of BLOCK_K (the
    masked tail), N = 45 not a multiple of BLOCK_N."""
    needs_row_invariant_dot()
    g = torch.Generator().manual_seed(stable_seed("det-mm", dtype, bias))
    M, K, N = 64, 83, 45
    x = torch.randn(M, K, generator=g).to(dtype).to(DEVICE)
    w = (0.1 * torch.randn(N, K, generator=g)).to(dtype).to(DEVICE)
    b = torch.randn(N, generator=g).to(dtype).to(DEVICE) if bias else None
    full = deterministic_linear(x, w, b, backend="triton")
    ref = matmul_ref(x.double(), w.double(), None if b is None else b.double())
    assert full.dtype == dtype and full.shape == (M, N)
    assert rel_err(full, ref) < TOL[dtype]
    for m in ROW_COUNTS[:-1]:
        for start in (0, (M - m) // 2, M - m):
            part = deterministic_linear(x[start:start + m], w, b, backend="triton")
            assert torch.equal(part, full[start:start + m]), f"{m} rows from {start}"
    # a 3-d input (tokens, heads, ...) flattens to rows the same way
    assert torch.equal(deterministic_linear(x.view(4, 16, K), w, b, backend="triton").view(M, N), full)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_rows_are_the_same_bits_for_every_row_count(dtype):
    g = torch.Generator().manual_seed(stable_seed("det-rms", dtype))
    M, H = 64, 100
    x = (3 * torch.randn(M, H, generator=g)).to(dtype).to(DEVICE)
    w = (1 + 0.2 * torch.randn(H, generator=g)).to(dtype).to(DEVICE)
    full = rms_norm_deterministic(x, w, 1e-5, backend="triton")
    ref = rms_norm(x.double(), w.double(), 1e-5)
    assert full.dtype == dtype and rel_err(full, ref) < TOL[dtype]
    for m in ROW_COUNTS[:-1]:
        for start in (0, M - m):
            assert torch.equal(rms_norm_deterministic(x[start:start + m], w, 1e-5, backend="triton"),
                               full[start:start + m])
    # (T, heads, head_dim) views of a wider tensor, as q / k norms take them
    wide = torch.randn(5, 3 * H + 7, generator=g).to(dtype).to(DEVICE)
    view = wide[:, :3 * H].view(5, 3, H)
    out = rms_norm_deterministic(view, w, 1e-5, backend="triton")
    assert torch.equal(out, rms_norm_deterministic(view.reshape(15, H), w, 1e-5, backend="triton").view(5, 3, H))


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_matmul_rows_are_the_same_bits_for_every_row_count(kind, dtype):
    """Deterministic mode's quantized path: always the GEMM with one config (the default path
    takes the GEMV for one row, whose reduction order differs)."""
    needs_row_invariant_dot()
    g = torch.Generator().manual_seed(stable_seed("det-qmm", kind, dtype))
    M, K, N = 64, 96, 45
    x = torch.randn(M, K, generator=g).to(dtype).to(DEVICE)
    blocks = random_blocks(N, K, kind, generator=g).to(DEVICE)
    full = quant_matmul_deterministic(x, blocks, kind, backend="triton")
    ref = x.double() @ dequantize_blocks(blocks, kind, torch.float64).t()
    assert full.dtype == dtype and rel_err(full, ref) < TOL[dtype]
    for m in ROW_COUNTS[:-1]:
        for start in (0, M - m):
            part = quant_matmul_deterministic(x[start:start + m], blocks, kind, backend="triton")
            assert torch.equal(part, full[start:start + m]), f"{m} rows from {start}"
    assert quant_matmul_deterministic(x[:0], blocks, kind, backend="triton").shape == (0, N)
