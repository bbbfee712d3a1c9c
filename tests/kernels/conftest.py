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
