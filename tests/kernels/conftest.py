import functools

import pytest
import torch

from pagedecode.kernels._backend import HAS_TRITON, interpreting

needs_triton = pytest.mark.skipif(not HAS_TRITON or not (interpreting() or torch.cuda.is_available()),
                                  reason="needs triton (interpreter on CPU, or CUDA)")
DEVICE = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def random_page_tables(lens, page_size, num_pages, gen=None):
    """A page table whose pages are a random permutation of the pool (never randint: no reuse)."""
    need = [-(-n // page_size) for n in lens]
    perm = torch.randperm(num_pages, generator=gen)
    assert sum(need) <= num_pages
    table = torch.full((len(lens), max(need) + 1), -1, dtype=torch.int32)   # one unused column
    at = 0
    for i, k in enumerate(need):
        table[i, :k] = perm[at:at + k].to(torch.int32)
        at += k
    return table


@functools.cache
def _interpreter_dot_is_row_invariant() -> bool:
    """Whether a bare masked tl.dot tile gives row i the same bits whatever the other rows hold,
    under Triton's interpreter (it calls numpy's matmul, i.e. the machine's OpenBLAS). Some
    OpenBLAS kernels (Zen / Haswell sgemm on an AMD EPYC) are not, so a kernel's row-count
    invariance cannot be shown by the interpreter there; on CUDA it is what the GPU computes."""
    if not HAS_TRITON or not interpreting():
        return True
    import triton
    import triton.language as tl

    @triton.jit
    def tile_dot(x_ptr, w_ptr, out_ptr, M, K: tl.constexpr, N: tl.constexpr, BLOCK_M: tl.constexpr):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rk, rn = tl.arange(0, K), tl.arange(0, N)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=rm[:, None] < M, other=0.0)
        w = tl.load(w_ptr + rk[:, None] * N + rn[None, :])
        acc = tl.dot(x, w, tl.zeros([BLOCK_M, N], tl.float32), input_precision="ieee")
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc, mask=rm[:, None] < M)

    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g)

    def run(rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty(rows.shape[0], 64)
        tile_dot[(triton.cdiv(rows.shape[0], 16),)](rows.contiguous(), w, out, rows.shape[0], K=64, N=64, BLOCK_M=16)
        return out

    full = run(x)
    return all(torch.equal(run(x[i:i + 1])[0], full[i]) for i in (0, 17, 31, 63))


def needs_row_invariant_dot() -> None:
    """Skip (naming why) where the interpreter's own dot is not row-invariant on this machine."""
    if not _interpreter_dot_is_row_invariant():
        pytest.skip("Triton's interpreter calls this machine's OpenBLAS for tl.dot, whose sgemm is not "
                    "row-invariant here (a masked tile's row differs with the other rows): bitwise row-count "
                    "invariance is shown on CUDA (benchmarks/device_check.sh) or where the BLAS is")
