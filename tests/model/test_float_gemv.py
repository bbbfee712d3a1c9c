"""csrc/float_gemv.h: the compiled forward's float gemv (a decode step's and a speculative verify's
few rows, float32 and bfloat16 weights). A row's outputs are the bits its 1-row call gives at any
row count and thread count (so a verify scores exactly what decoding would), and the products are
right against float64."""
import pytest
import torch

from pagedecode.model.cpu_forward import cpu_ext

ext = cpu_ext()
pytestmark = pytest.mark.skipif(ext is None, reason="pagedecode._cpu not built")

# (K, N): SmolLM2's layers, and odd shapes: K past a multiple of 8, N past the tiles' 3 and 8 outputs
SHAPES = [(576, 960), (1536, 576), (67, 29), (13, 17), (8, 5), (3, 1)]
ROWS = (1, 2, 3, 4, 5, 7, 8, 12, 13, 17, 24, 25, 40)


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,n", SHAPES)
def test_each_rows_outputs_are_its_one_row_calls_bits_at_any_row_count(dtype, k, n):
    g = torch.Generator().manual_seed(k * 100 + n)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(max(ROWS), k, generator=g).to(dtype)
    alone = torch.cat([ext.gemv(x[i:i + 1], w) for i in range(len(x))])
    for rows in ROWS:
        assert torch.equal(ext.gemv(x[:rows], w), alone[:rows]), f"{rows} rows"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 8e-3)])
@pytest.mark.parametrize("k,n", SHAPES)
def test_the_products_match_float64(dtype, tol, k, n):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(17, k, generator=g).to(dtype)
    want = x.double() @ w.double().T              # the inputs as given; bf16 rounds only the output
    got = ext.gemv(x, w).double()
    assert (got - want).abs().max() <= tol * want.abs().max()


def test_the_same_bits_at_one_two_and_four_threads(threads):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3072, 576, generator=g)           # enough bytes to be split across threads
    xs = [torch.randn(rows, 576, generator=g) for rows in (1, 5, 17)]
    torch.set_num_threads(1)
    want = [ext.gemv(x, w) for x in xs]
    for t in (2, 4):
        torch.set_num_threads(t)
        for x, y in zip(xs, want):
            assert torch.equal(ext.gemv(x, w), y), f"{t} threads, {len(x)} rows"


def test_nan_in_one_row_stays_in_that_row():
    w = torch.randn(40, 64)
    x = torch.randn(9, 64)
    x[4, 10] = float("nan")
    y = ext.gemv(x, w)
    assert torch.isnan(y[4]).all()
    assert torch.isfinite(torch.cat([y[:4], y[5:]])).all()
