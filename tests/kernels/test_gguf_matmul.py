"""The GEMV / GEMM for GGUF's Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K blocks (kernels/gguf_matmul.py)
against a float64 product with the dequantized weight: N = 111 (not a multiple of 16), K at the
type's block multiple, M = 1 (the GEMV), 3 and 17 (the GEMM; 17 a second, 1-row tile),
float32 / float16 / bfloat16 activations, every output written (NaN-poisoned first); the kernels'
dequantization bit for bit as quant_types' (itself gguf's)."""
import pytest
import torch

from pagedecode.kernels import gguf_matmul as GM
from pagedecode.kernels._backend import interpreting
from pagedecode.kernels.gguf_matmul import KINDS, gguf_dequantize_triton, gguf_matmul_ref, gguf_matmul_triton
from pagedecode.kernels.quant_matmul import quant_matmul, quant_matmul_deterministic
from pagedecode.kernels.quant_types import BLOCK_TYPES, dequantize, random_blocks

from .conftest import DEVICE, TOL, needs_row_invariant_dot, needs_triton, rel_err

N = 111


def oracle(x: torch.Tensor, blocks: torch.Tensor, kind: str) -> torch.Tensor:
    return x.double().cpu() @ dequantize(blocks.cpu(), kind, torch.float64).t()


def inputs(kind: str, M: int, K: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    blocks = random_blocks(N, K, kind, generator=g).to(DEVICE)
    return torch.randn(M, K, generator=g).to(dtype).to(DEVICE), blocks


@needs_triton
@pytest.mark.parametrize("kind", KINDS)
def test_kernel_dequantization_is_quant_types_bit_for_bit(kind):
    """Two blocks a row (three for the 32-blocks), 111 rows; scales up to 8 (the largest K-quant
    value, 8 x 127 x 32, still a float16) and every byte value
    (random_blocks). Float32 out: the same bits; float16 out: the same float32 rounded (not
    bfloat16: the interpreter's float32 -> bfloat16 conversion truncates where the GPU rounds)."""
    k = 2 * BLOCK_TYPES[kind].block if kind.endswith("_k") else 3 * 32
    blocks = random_blocks(N, k, kind, generator=torch.Generator().manual_seed(len(kind)), scale=8.0).to(DEVICE)
    want = dequantize(blocks.cpu(), kind)
    out = torch.full((N, k), float("nan"), device=DEVICE)
    got = gguf_dequantize_triton(blocks, kind, out=out).cpu()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(gguf_dequantize_triton(blocks, kind, torch.float16).cpu(), want.to(torch.float16))


@needs_triton
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("M, dtype", [(1, torch.float32), (1, torch.float16), (1, torch.bfloat16), (3, torch.float16),
                                      (17, torch.float32), (17, torch.float16), (17, torch.bfloat16)])
def test_kernel_matches_the_float64_product(kind, dtype, M):
    """Each activation type through the GEMV (M = 1) and the GEMM (17: a second, 1-row tile; 3 in
    float16 only, the interpreter is slow). K: 96 / 288 for the 32-blocks (ending partway through
    the kernels' 128-wide K tiles), 256 / 512 for the K-quants (one super-block, two)."""
    K = (96 if M < 17 else 288) if BLOCK_TYPES[kind].block == 32 else (256 if M < 17 else 512)
    x, blocks = inputs(kind, M, K, dtype, seed=M * 1000 + K + len(kind))
    out = torch.full((M, N), float("nan"), dtype=dtype, device=DEVICE)
    got = gguf_matmul_triton(x, blocks, kind, out=out)
    assert got.data_ptr() == out.data_ptr() and not out.isnan().any()      # every output written
    ref = oracle(x, blocks, kind)
    assert rel_err(out.cpu(), ref) < TOL[dtype]
    atol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double().cpu(), ref, rtol=2 * TOL[dtype], atol=atol * ref.abs().max().item())


@needs_triton
@pytest.mark.parametrize("kind", ["q5_1", "q4_k", "q6_k"])
def test_dispatch_by_row_count_and_backend(kind, monkeypatch):
    """quant_matmul sends these types to the GEMV (one row), the GEMM (up to GEMM_MAX_ROWS), the
    dequantizing kernel + matmul past it; backend="torch" to the reference; (B, T, K) in gives
    (B, T, N) out; deterministic mode always takes the GEMM."""
    K = BLOCK_TYPES[kind].block * (1 if kind.endswith("_k") else 3)
    x, blocks = inputs(kind, 6, K, torch.float32, seed=7)
    calls = []
    for name in ("gguf_gemv_triton", "gguf_gemm_triton", "gguf_dequantize_triton"):
        real = getattr(GM, name)
        monkeypatch.setattr(GM, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    ref = oracle(x, blocks, kind)
    y = quant_matmul(x.view(2, 3, K), blocks, kind, backend="triton")
    assert y.shape == (2, 3, N) and calls == ["gguf_gemm_triton"] and rel_err(y.reshape(6, N).cpu(), ref) < 1e-5
    y = quant_matmul(x[:1], blocks, kind, backend="triton")
    assert calls[-1] == "gguf_gemv_triton" and rel_err(y.cpu(), ref[:1]) < 1e-5
    monkeypatch.setattr(GM, "GEMM_MAX_ROWS", 5)                       # long prefills: dequantize + matmul
    y = quant_matmul(x, blocks, kind, backend="triton")
    assert calls[-1] == "gguf_dequantize_triton" and rel_err(y.cpu(), ref) < 1e-5
    n = len(calls)
    y = quant_matmul(x, blocks, kind, backend="torch")
    assert len(calls) == n and torch.allclose(y, gguf_matmul_ref(x, blocks, kind))
    y = quant_matmul_deterministic(x[:1], blocks, kind, backend="triton")
    assert calls[-1] == "gguf_gemm_triton" and rel_err(y.cpu(), ref[:1]) < 1e-5
    assert quant_matmul(x[:0], blocks, kind, backend="triton").shape == (0, N)


def test_bad_blocks_are_refused():
    blocks = random_blocks(4, 256, "q4_k")
    with pytest.raises(ValueError, match="do not match 512 inputs"):
        gguf_matmul_triton(torch.randn(1, 512), blocks, "q4_k")
    with pytest.raises(ValueError, match="do not match 256 inputs"):        # Q5_K: 176 bytes a super-block
        gguf_matmul_triton(torch.randn(1, 256), blocks, "q5_k")
    with pytest.raises(ValueError, match="kind must be one of"):
        gguf_matmul_triton(torch.randn(1, 256), blocks, "q8_0")


@needs_triton
@pytest.mark.parametrize("kind", ["q5_0", "q4_k"])
def test_deterministic_rows_are_the_same_bits_for_every_row_count(kind):
    """Deterministic mode's path for these types: always the GEMM with one config, so rows 1, 3 or
    17 at a time are the bits of the 33-row product (where the interpreter's own dot is row-invariant)."""
    needs_row_invariant_dot()
    K = BLOCK_TYPES[kind].block * (1 if kind.endswith("_k") else 3)
    x, blocks = inputs(kind, 33, K, torch.float32, seed=11)
    full = quant_matmul_deterministic(x, blocks, kind, backend="triton")
    assert rel_err(full.cpu(), oracle(x, blocks, kind)) < TOL[torch.float32]
    for m, start in ((1, 0), (1, 32), (3, 5), (17, 16)):
        assert torch.equal(quant_matmul_deterministic(x[start:start + m], blocks, kind, backend="triton"),
                           full[start:start + m]), f"{m} rows from {start}"


@pytest.mark.skipif(not torch.cuda.is_available() or interpreting(), reason="needs CUDA and compiled Triton")
def test_kernel_sweep_gguf_and_lora_rows_on_cuda():
    """The device check's timing rows, small: each checked against the reference first."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import kernel_sweep
    bw = kernel_sweep.copy_bandwidth()
    for kind in KINDS:
        for M in (1, 17):                        # the GEMV and the GEMM (configs the tests above compiled)
            row = kernel_sweep.quant_case(kind, M, 1024, 512, bw, dense=False)
            assert "error" not in row and row["rel_err"] < 1.5e-2 and row["us"] > 0 and row["GB/s"] > 0, row
    row = kernel_sweep.lora_case(rows=16, adapters=4, rank=64, n=1024, k=512)
    assert row["rel_err"] < 1.5e-2 and row["us"] > 0, row
