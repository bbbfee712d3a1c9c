"""The quantized GEMV / GEMM (kernels/quant_matmul.py) against a float64 product with the
dequantized weight: odd shapes (K not a multiple of the kernels' K tiles, N = 111), both block
kinds, float32 / float16 / bfloat16 activations, every output written."""
import pytest
import torch

from pagedecode.kernels import quant_matmul as QM
from pagedecode.kernels._backend import interpreting
from pagedecode.kernels.quant_matmul import (BLOCK_BYTES, dequantize_blocks, quant_matmul, quant_matmul_ref,
                                             quant_matmul_triton, random_blocks)

from .conftest import DEVICE, TOL, needs_triton, rel_err

KINDS = list(BLOCK_BYTES)


def oracle(x: torch.Tensor, blocks: torch.Tensor, kind: str) -> torch.Tensor:
    return x.double() @ dequantize_blocks(blocks, kind, torch.float64).t()


@pytest.mark.parametrize("kind", KINDS)
def test_random_blocks_use_every_quant_and_dequantize_as_gguf_does(kind):
    """The kernels are tested on random bytes (every quant value, -128 included, which gguf's
    quantizer never writes), with finite scales; dequantize_blocks is gguf's formula."""
    gguf = pytest.importorskip("gguf")
    blocks = random_blocks(64, 96, kind, generator=torch.Generator().manual_seed(1))
    assert blocks.shape == (64, 3 * BLOCK_BYTES[kind]) and blocks.dtype == torch.uint8
    w = dequantize_blocks(blocks, kind)
    assert torch.isfinite(w).all() and w.abs().max() > 0
    qtype = gguf.GGMLQuantizationType.Q8_0 if kind == "q8_0" else gguf.GGMLQuantizationType.Q4_0
    assert torch.equal(w, torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), qtype)))
    payload = blocks.view(64, 3, -1)[..., 2:]
    assert payload.unique().numel() == 256


@needs_triton
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M, K, N", [(1, 224, 111), (3, 288, 111), (17, 224, 111), (4, 32, 17), (5, 288, 40)])
def test_kernel_matches_the_float64_product(kind, dtype, M, K, N):
    """M = 1: the GEMV; more: the GEMM (M = 17: a second, 1-row tile). K = 224 and 288 end
    partway through a K tile; N = 111 partway through an N tile."""
    g = torch.Generator().manual_seed(M * 1000 + K + N)
    blocks = random_blocks(N, K, kind, generator=g).to(DEVICE)
    x = torch.randn(M, K, generator=g).to(dtype).to(DEVICE)
    out = torch.full((M, N), float("nan"), dtype=dtype, device=DEVICE)
    got = quant_matmul_triton(x, blocks, kind, out=out)
    assert got.data_ptr() == out.data_ptr() and not out.isnan().any()      # every output written
    ref = oracle(x, blocks, kind)
    assert rel_err(out, ref) < TOL[dtype]
    atol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, rtol=2 * TOL[dtype], atol=atol * ref.abs().max().item())


@needs_triton
@pytest.mark.parametrize("kind", KINDS)
def test_batched_input_shape_and_dispatch(kind, monkeypatch):
    """(B, T, K) in, (B, T, N) out; `backend` picks the kernel or the reference; the GEMV takes up
    to GEMV_MAX_ROWS rows (one), the GEMM up to GEMM_MAX_ROWS, then dequantize + matmul; zero
    rows give an empty result."""
    g = torch.Generator().manual_seed(7)
    blocks = random_blocks(40, 64, kind, generator=g).to(DEVICE)
    calls = []
    for name in ("quant_gemv_triton", "quant_gemm_triton"):
        real = getattr(QM, name)
        monkeypatch.setattr(QM, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    x = torch.randn(2, 3, 64, generator=g).to(DEVICE)                 # 6 rows: the GEMM
    y = quant_matmul(x, blocks, kind, backend="triton")
    assert y.shape == (2, 3, 40) and calls == ["quant_gemm_triton"]
    assert rel_err(y, oracle(x.reshape(6, 64), blocks, kind).view(2, 3, 40)) < 1e-5
    assert quant_matmul(x[0, :1], blocks, kind, backend="triton").shape == (1, 40) and calls[-1] == "quant_gemv_triton"
    n = len(calls)
    ref = quant_matmul(x, blocks, kind, backend="torch")
    assert len(calls) == n and torch.allclose(ref, quant_matmul_ref(x, blocks, kind))
    assert quant_matmul(x[:, :0], blocks, kind, backend="triton").shape == (2, 0, 40)
    monkeypatch.setattr(QM, "GEMM_MAX_ROWS", 5)                    # long prefills: dequantize + matmul
    n = len(calls)
    y = quant_matmul(x, blocks, kind, backend="triton")
    assert len(calls) == n and rel_err(y, oracle(x.reshape(6, 64), blocks, kind).view(2, 3, 40)) < 1e-5


def test_bad_blocks_are_refused():
    blocks = random_blocks(4, 64, "q8_0")
    with pytest.raises(ValueError, match="do not match 96 inputs"):
        quant_matmul(torch.randn(1, 96), blocks, "q8_0", backend="torch")
    with pytest.raises(ValueError, match="do not match 64 inputs"):
        quant_matmul(torch.randn(1, 64), blocks, "q4_0", backend="torch")
    with pytest.raises(ValueError, match="kind must be one of"):
        quant_matmul(torch.randn(1, 64), blocks, "q3_k", backend="torch")
    with pytest.raises(ValueError, match="do not match 64 inputs"):          # Q5_0: 22 bytes a block
        quant_matmul(torch.randn(1, 64), blocks, "q5_0", backend="torch")


@pytest.mark.skipif(not torch.cuda.is_available() or interpreting(), reason="needs CUDA and compiled Triton")
@pytest.mark.parametrize("kind", KINDS)
def test_kernel_sweep_quant_rows_on_cuda(kind):
    """The device check's timing path, small: each row checked against the reference first."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import kernel_sweep
    bw = kernel_sweep.copy_bandwidth()
    for M in (1, 16, 256):
        row = kernel_sweep.quant_case(kind, M, 1024, 512, bw)
        assert "error" not in row and row["rel_err"] < 1.5e-2 and row["us"] > 0 and row["GB/s"] > 0, row
