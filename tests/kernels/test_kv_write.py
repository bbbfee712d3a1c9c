import pytest
import torch

from pagedecode.kernels.kv_write import write_kv, write_kv_ref

from .conftest import DEVICE, needs_triton


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("page,heads,d", [(16, 2, 64), (8, 5, 128), (128, 1, 64)])
def test_kv_write_matches_reference(dtype, page, heads, d):
    g = torch.Generator().manual_seed(page * heads + d)
    num_pages = 6
    T = 13
    slots = torch.randperm(num_pages * page, generator=g)[:T]
    slots[3] = -1                                                  # padding row: nothing written
    k = torch.randn(T, heads, d, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(T, heads, d, generator=g).to(dtype).to(DEVICE)
    kc = torch.full((num_pages, page, heads, d), float("nan"), dtype=dtype, device=DEVICE)
    vc = kc.clone()
    kr, vr = kc.clone(), vc.clone()
    write_kv(kc, vc, k, v, slots.to(DEVICE), backend="triton")
    write_kv_ref(kr, vr, k, v, slots.to(DEVICE))
    assert torch.equal(kc.isnan(), kr.isnan())
    assert torch.equal(kc.nan_to_num(), kr.nan_to_num()) and torch.equal(vc.nan_to_num(), vr.nan_to_num())
    written = (~kc.isnan()).reshape(-1, heads * d).all(-1).sum().item()
    assert written == T - 1
