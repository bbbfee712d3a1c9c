"""The compiled CPU kernels of GGUF's other block types (csrc/quant_types.h: Q4_1, Q5_0, Q5_1,
Q4_K, Q5_K, Q6_K): the embedding rows against gguf's dequantizer, the matmul against dequantized
weights x float activations within the bound of llama.cpp's activation quantization for the
type, the GEMM's rows equal to the GEMV's and the same bits at 1, 2 and 4 threads."""
import numpy as np
import pytest
import torch

from pagedecode.kernels.quant_types import BLOCK_TYPES, dequantize, random_blocks
from pagedecode.model.cpu_forward import _cpu_ext as _cpu
from pagedecode.model.quant import QuantizedWeight

from ..kernels.test_quant_types import extreme_blocks

gguf = pytest.importorskip("gguf")
KINDS = ["q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"]
pytestmark = pytest.mark.skipif(not hasattr(_cpu, "quant_block_kinds"),
                                reason="pagedecode._cpu not built, or built before csrc/quant_types.h")


def weight(n: int, k: int, kind: str, seed: int) -> QuantizedWeight:
    return QuantizedWeight(kind, random_blocks(n, k, kind, generator=torch.Generator().manual_seed(seed)), (n, k))


def activation_step(x: torch.Tensor, kind: str) -> torch.Tensor:
    """(T, K): each input's quantization step, its activation block's max |x| / 127 (blocks of 32:
    Q8_0 / Q8_1; of 256: Q8_K)."""
    block = 256 if kind.endswith("_k") else 32
    T, K = x.shape
    step = x.abs().reshape(T, K // block, block).amax(-1, keepdim=True) / 127
    return step.expand(T, K // block, block).reshape(T, K)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("T, N, blocks", [(1, 96, 3), (3, 7, 2), (17, 100, 3), (70, 33, 1), (2, 300, 6)])
def test_kernel_within_the_activation_rounding_bound(kind, T, N, blocks):
    """|y - x @ W^T| <= sum_j |w_j| * step_j / 2 (+ float rounding): llama.cpp's own error for the
    type, as its activations are rounded to the same grid (the exact bound is checked, and that it
    is reached at ~ its expected size, not zero)."""
    K = BLOCK_TYPES[kind].block * blocks
    q = weight(N, K, kind, seed=T * N + blocks)
    g = torch.Generator().manual_seed(T + N)
    x = torch.randn(T, K, generator=g) * torch.rand(T, 1, generator=g) * 4
    x[0, :32] = 0.0                                                  # an all-zero activation block
    w = q.dequantize(torch.float64)
    ref = x.double() @ w.t()
    y = _cpu.quant_linear(x, q.kernel_blocks(), N)
    assert y.shape == (T, N) and y.dtype == torch.float32
    bound = 0.5 * activation_step(x, kind).double() @ w.abs().t()
    slack = 1e-5 * (x.double().abs() @ w.abs().t()) + 1e-30
    err = (y.double() - ref).abs()
    assert (err <= bound * 1.0001 + slack).all(), (err - bound).max()
    assert err.max() > 0 and err.max() < 0.02 * ref.abs().max()


@pytest.mark.parametrize("kind", KINDS)
def test_gemm_rows_equal_the_gemv_and_any_thread_count(kind):
    """Each output accumulates its blocks in order in its own registers whatever the tokens of
    the call (tiles of 64 tokens: 131 spans three) or the thread computing its rows (chunks on
    the pool under 8 tokens, OpenMP from 8)."""
    K = BLOCK_TYPES[kind].block * 3
    q = weight(301, K, kind, seed=5)
    x = torch.randn(131, K, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = _cpu.quant_linear(x, q.kernel_blocks(), 301)
        rows = torch.cat([_cpu.quant_linear(x[t:t + 1], q.kernel_blocks(), 301) for t in range(0, 131, 13)])
        assert torch.equal(rows, want[::13])
        for n in (2, 4):
            torch.set_num_threads(n)
            for _ in range(5):
                assert torch.equal(_cpu.quant_linear(x, q.kernel_blocks(), 301), want)
                assert torch.equal(_cpu.quant_linear(x[5:9], q.kernel_blocks(), 301), want[5:9])
                assert torch.equal(_cpu.quant_linear(x[7:8], q.kernel_blocks(), 301), want[7:8])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("T", [5, 17, 21, 64, 65])
def test_gemm_of_odd_token_counts_is_the_gemv_row_by_row(kind, T):
    """Token counts that leave a partial register tile (the GEMM's tiles hold 4 tokens, 2 rows;
    N = 37 leaves a lone row; Q6_K's rows decoded once for 16 tokens and more, then 8 at a time:
    17 leaves one token, 21 five) and one past a 64-token block: every row the gemv's bits."""
    K = BLOCK_TYPES[kind].block * (3 if kind.endswith("_k") else 18)
    q = weight(37, K, kind, seed=T)
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(T)) * 2
    y = _cpu.quant_linear(x, q.kernel_blocks(), 37)
    rows = torch.cat([_cpu.quant_linear(x[t:t + 1], q.kernel_blocks(), 37) for t in range(T)])
    assert torch.equal(y, rows)


@pytest.mark.parametrize("kind", KINDS)
def test_embedding_rows_are_ggufs_floats(kind):
    """The compiled forward's embedding lookup dequantizes the rows it reads, to gguf's bits (random
    bytes and any finite float16 scale)."""
    K = BLOCK_TYPES[kind].block * 2
    blocks = extreme_blocks(50, K, kind, torch.Generator().manual_seed(9))
    q = QuantizedWeight(kind, blocks, (50, K))
    ids = torch.tensor([3, 0, 49, 3, 17])
    got = _cpu.quant_embedding_rows(q.kernel_blocks(), ids, K)
    want = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[kind.upper()])[ids.numpy()]
    assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))
    assert torch.equal(q.dequantize(rows=ids), torch.from_numpy(want))
    with pytest.raises(RuntimeError, match="out of range"):
        _cpu.quant_embedding_rows(q.kernel_blocks(), torch.tensor([50]), K)


def test_kernel_refuses_blocks_of_no_type():
    x = torch.randn(2, 256)
    with pytest.raises(RuntimeError, match="no GGUF block type"):
        _cpu.quant_linear(x, torch.zeros(4, 8, 21, dtype=torch.uint8), 4)       # 8 x 32, 21 bytes
    with pytest.raises(RuntimeError, match="no GGUF block type"):
        _cpu.quant_linear(x, torch.zeros(4, 2, 144, dtype=torch.uint8), 4)      # Q4_K's size, but 2 x 128


def llama_cpp_activations(x: torch.Tensor, kind: str) -> torch.Tensor:
    """x (T, K) as llama.cpp's activation quantization for `kind` leaves it (float64): Q8_0 / Q8_1
    per 32, d = max |x| / 127, q = round(x / d); Q8_K per 256, d = -max / 127 for the x of largest
    |x|, q = min(127, round(x / d)) (float32 arithmetic, ties to even, as both round)."""
    block = 256 if kind.endswith("_k") else 32
    T, K = x.shape
    b = x.reshape(T, K // block, block)
    if block == 32:
        d = b.abs().amax(-1, keepdim=True) / 127
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = torch.round(b * inv)
    else:
        at = b.abs().argmax(-1, keepdim=True)
        iscale = -127 / b.gather(-1, at)
        iscale = torch.where(torch.isfinite(iscale), iscale, torch.zeros_like(iscale))
        q = torch.clamp(torch.round(iscale * b), max=127)
        d = torch.where(iscale != 0, 1 / iscale, torch.zeros_like(iscale))
    return (q.double() * d.double()).reshape(T, K)


@pytest.mark.parametrize("kind", KINDS)
def test_kernel_is_the_exact_product_of_llama_cpps_rounded_activations(kind):
    """Stronger than the bound: against float64 (rounded x) @ W^T the kernel differs by float
    rounding alone (its integer dots are exact), so no term (a min, a sub-block's scale) is off."""
    K = BLOCK_TYPES[kind].block * 4
    q = weight(67, K, kind, seed=21)
    x = torch.randn(19, K, generator=torch.Generator().manual_seed(4)) * 3
    ref = llama_cpp_activations(x, kind) @ q.dequantize(torch.float64).t()
    y = _cpu.quant_linear(x, q.kernel_blocks(), 67).double()
    scale = (x.double().abs() @ q.dequantize(torch.float64).abs().t())
    assert ((y - ref).abs() <= 2e-6 * scale).all(), ((y - ref).abs() / scale).max()


@pytest.mark.parametrize("kind", KINDS)
def test_deterministic_modes_det_linear_takes_these_blocks(kind):
    """det_linear (deterministic mode's matmul) hands (N, blocks, type size) blocks to the same kernel."""
    K = BLOCK_TYPES[kind].block * 2
    q = weight(40, K, kind, seed=2)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(1))
    assert torch.equal(_cpu.det_linear(x, q.kernel_blocks()), _cpu.quant_linear(x, q.kernel_blocks(), 40))
