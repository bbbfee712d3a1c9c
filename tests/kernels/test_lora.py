"""The segmented LoRA delta (kernels/lora.py): the Triton shrink / expand kernels against a float64
oracle and the torch reference, at odd ranks (1, 8, 13, 64), odd and empty segments, several
adapters and rows without one in one batch, float32 / float16 / bfloat16 activations, every
output element written (the buffer is poisoned with NaN first)."""
import pytest
import torch

from pagedecode.kernels import lora as L
from pagedecode.kernels.lora import lora_config, lora_delta, lora_delta_reference, lora_delta_triton

from .conftest import DEVICE, TOL, needs_triton, rel_err

K, N = 80, 72                  # K ends partway through a 64-wide K tile, N partway through an N tile


def make_case(sizes: list[int], slots: list[int], rank: int, dtype: torch.dtype, adapters: int = 3, seed: int = 0):
    """x (M, K) and a stack of `adapters` adapters of rank `rank`, with segments of `sizes` rows."""
    g = torch.Generator().manual_seed(seed)
    M = sum(sizes)
    x = torch.randn(M, K, generator=g).to(dtype)
    a = (torch.randn(adapters, rank, K, generator=g) / K ** 0.5).to(dtype)
    b = (torch.randn(adapters, N, rank, generator=g) / rank ** 0.5).to(dtype)
    scaling = torch.rand(adapters, generator=g) + 0.5
    starts = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int32)
    return [t.to(DEVICE) for t in (x, starts, torch.tensor(slots, dtype=torch.int32), a, b, scaling)]


def oracle(x, seg_starts, seg_slots, a, b, scaling) -> torch.Tensor:
    out = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float64)
    starts = seg_starts.tolist()
    for g, slot in enumerate(seg_slots.tolist()):
        if slot >= 0:
            rows = x[starts[g]:starts[g + 1]].double().cpu()
            out[starts[g]:starts[g + 1]] = rows @ a[slot].double().cpu().T @ b[slot].double().cpu().T \
                * scaling[slot].double().item()
    return out


def run_poisoned(case, **config):
    x = case[0]
    out = torch.full((x.shape[0], case[4].shape[1]), float("nan"), dtype=x.dtype, device=DEVICE)
    cfg = {**lora_config(x.shape[0], x.shape[1]), **config}
    got = lora_delta_triton(*case, out=out, **cfg)
    assert got.data_ptr() == out.data_ptr() and not out.isnan().any()         # every element written
    return out


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert rel_err(out, ref) < TOL[dtype]
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double().cpu(), ref, rtol=2 * TOL[dtype], atol=atol * ref.abs().max().item())


# segments: 3 rows of adapter 1, none of adapter 2, 17 without an adapter, 1 of adapter 0, 5 of
# adapter 1 again (an adapter may have two segments), none without an adapter
MIXED = ([3, 0, 17, 1, 5, 0], [1, 2, -1, 0, 1, -1])


@needs_triton
@pytest.mark.parametrize("rank", [1, 8, 13, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mixed_batch_matches_the_float64_oracle(rank, dtype):
    case = make_case(*MIXED, rank=rank, dtype=dtype, seed=rank)
    out = run_poisoned(case)
    assert_matches(out, oracle(*case), dtype)
    assert (out[3:20] == 0).all()                                    # rows without an adapter: exactly zero
    ref = lora_delta_reference(*case)                                # the definition, within float32 rounding
    assert rel_err(out, ref) < (1e-6 if dtype == torch.float32 else TOL[dtype])


@needs_triton
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_adapter_at_odd_row_counts(rows, dtype):
    case = make_case([rows], [2], rank=13, dtype=dtype, seed=100 + rows)
    assert_matches(run_poisoned(case), oracle(*case), dtype)


@needs_triton
def test_k_split_partials_sum_to_the_same_delta():
    """K = 80 cut into 3 ranges of 32 inputs (the last partial): the partial products summed in
    split order give the delta of the unsplit kernel within float32 rounding."""
    case = make_case(*MIXED, rank=8, dtype=torch.float32, seed=3)
    split = run_poisoned(case, block_k=32, k_per_split=32)
    assert_matches(split, oracle(*case), torch.float32)
    assert rel_err(split, run_poisoned(case)) < 1e-6


@needs_triton
def test_a_rows_delta_does_not_depend_on_the_rows_beside_it():
    """Rows 3..19 of the mixed batch computed alone: each row's K order is fixed, so the same
    delta (on the GPU the same bits; the interpreter's BLAS may round a tile's rows by its
    neighbours, so here within float32 rounding)."""
    case = make_case(*MIXED, rank=8, dtype=torch.float32, seed=4)
    case[2][2] = 0                                                   # the 17-row segment gets adapter 0
    full = run_poisoned(case)
    alone = [case[0][3:20], torch.tensor([0, 17], dtype=torch.int32, device=DEVICE),
             torch.tensor([0], dtype=torch.int32, device=DEVICE), *case[3:]]
    assert rel_err(run_poisoned(alone), full[3:20]) < 1e-6


@needs_triton
def test_dispatch_and_empty_inputs(monkeypatch):
    """backend="triton" runs the kernels, "torch" the reference; no rows, or no segments, give an
    empty or all-zero result."""
    case = make_case([4, 2], [0, -1], rank=8, dtype=torch.float32, seed=5)
    calls = []
    real = L.lora_delta_triton
    monkeypatch.setattr(L, "lora_delta_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = lora_delta(*case, backend="triton")
    assert calls == [1] and got.shape == (6, N) and got.dtype == torch.float32
    ref = lora_delta(*case, backend="torch")
    assert calls == [1] and rel_err(got, ref) < 1e-6
    empty = [case[0][:0], torch.tensor([0, 0], dtype=torch.int32, device=DEVICE), case[2][:1], *case[3:]]
    assert lora_delta(*empty, backend="triton").shape == (0, N)


def test_bad_segments_and_shapes_are_refused():
    x, starts, slots, a, b, scaling = make_case([4, 2], [0, -1], rank=8, dtype=torch.float32)
    x, starts, slots = x.cpu(), starts.cpu(), slots.cpu()
    a, b, scaling = a.cpu(), b.cpu(), scaling.cpu()
    with pytest.raises(ValueError, match="do not cover the 6 rows"):
        lora_delta(x, torch.tensor([0, 4, 5], dtype=torch.int32), slots, a, b, scaling, backend="torch")
    with pytest.raises(ValueError, match="do not cover the 6 rows"):
        lora_delta(x, torch.tensor([0, 5, 4], dtype=torch.int32), slots, a, b, scaling, backend="torch")
    with pytest.raises(ValueError, match="outside -1 .. 2"):
        lora_delta(x, starts, torch.tensor([3, -1], dtype=torch.int32), a, b, scaling, backend="torch")
    with pytest.raises(ValueError, match="lora shapes do not fit"):
        lora_delta(x[:, :40], starts, slots, a, b, scaling, backend="torch")
    with pytest.raises(ValueError, match="lora shapes do not fit"):
        lora_delta(x, starts, slots, a, b[:, :, :4], scaling, backend="torch")
