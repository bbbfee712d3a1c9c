"""The rejection rule of speculative sampling (kernels/rejection.py): the Triton kernel equals
the torch reference token for token, exact cases behave exactly, and the output follows the
target distribution whatever the draft's (chi-square at p = 0.001)."""
import pytest
import torch

from pagedecode.kernels.rejection import rejection_sample, rejection_sample_ref

from .conftest import DEVICE, needs_triton



def chi_square_pvalue(seen: torch.Tensor, want: torch.Tensor) -> float:
    """Pearson's chi-square test of counts `seen` against probabilities `want`."""
    expected = want.double() / want.double().sum() * seen.double().sum()
    stat = ((seen.double() - expected) ** 2 / expected).sum()
    df = torch.tensor(len(seen) - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


def case(B, K, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(B, K + 1, V, generator=g) * 2, dim=-1)
    draft = torch.softmax(torch.randn(B, K, V, generator=g) * 2, dim=-1)
    ids = torch.multinomial(draft.reshape(-1, V), 1, generator=g).reshape(B, K)
    n = torch.randint(0, K + 1, (B,), generator=g, dtype=torch.int32)
    seeds = torch.randint(0, 2 ** 62, (B,), generator=g)
    index = torch.randint(0, 1000, (B,), generator=g)
    return target, draft, ids, n, seeds, index


@needs_triton
@pytest.mark.parametrize("B,K,V", [(37, 3, 111), (5, 1, 300), (9, 0, 17)])
def test_kernel_equals_reference(B, K, V):
    args = case(B, K, V)
    want = rejection_sample(*args, backend="torch")
    got = rejection_sample(*(a.to(DEVICE) for a in args), backend="triton")
    assert torch.equal(got.tokens.cpu(), want.tokens) and torch.equal(got.num_accepted.cpu(), want.num_accepted)
    for row, a in enumerate(want.num_accepted.tolist()):       # shape of the answer
        assert (want.tokens[row, :a + 1] >= 0).all() and (want.tokens[row, a + 1:] == -1).all()
        assert torch.equal(want.tokens[row, :a], args[2][row, :a])


def test_chi_square_helper_matches_known_values():
    # scipy.stats.chisquare([10, 20, 30, 40]).pvalue and ([240, 260, 250, 250])
    assert abs(chi_square_pvalue(torch.tensor([10, 20, 30, 40]), torch.ones(4)) - 1.6974e-4) < 1e-7
    assert abs(chi_square_pvalue(torch.tensor([240, 260, 250, 250]), torch.ones(4)) - 0.84947) < 1e-4


def test_exact_cases():
    V, B = 7, 16
    seeds, index = torch.arange(B), torch.zeros(B, dtype=torch.int64)
    ids = torch.full((B, 1), 3)
    one = torch.full((B,), 1, dtype=torch.int32)
    q = torch.full((B, 1, V), 1 / V)
    target_on_draft = torch.zeros(B, 2, V)
    target_on_draft[:, 0, 3] = 1
    target_on_draft[:, 1, 5] = 1
    out = rejection_sample_ref(target_on_draft, q, ids, one, seeds, index)
    assert out.num_accepted.tolist() == [1] * B and out.tokens.tolist() == [[3, 5]] * B
    target_elsewhere = torch.zeros(B, 2, V)
    target_elsewhere[:, :, 6] = 1
    out = rejection_sample_ref(target_elsewhere, q, ids, one, seeds, index)
    assert out.num_accepted.tolist() == [0] * B and out.tokens.tolist() == [[6, -1]] * B
    same = torch.softmax(torch.randn(B, 2, V), -1)
    out = rejection_sample_ref(same, same[:, :1], ids, one, seeds, index)    # q == p: always kept
    assert out.num_accepted.tolist() == [1] * B


def test_output_follows_the_target_distribution_chi_square():
    """Known distributions (a scripted target and draft): the first token follows p0 and the
    second (when the first draft was kept) p1, at p = 0.001, over 20,000 draws."""
    N, V = 20_000, 8
    p = torch.tensor([[0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.05, 0.02],
                      [0.05, 0.05, 0.10, 0.10, 0.15, 0.15, 0.20, 0.20],
                      [0.125] * 8])
    q = torch.tensor([[0.05, 0.05, 0.10, 0.30, 0.30, 0.10, 0.05, 0.05],
                      [0.40, 0.10, 0.10, 0.10, 0.10, 0.10, 0.05, 0.05]])
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=g) for j in range(2)], dim=1)
    out = rejection_sample_ref(p.expand(N, 3, V), q.expand(N, 2, V), ids, torch.full((N,), 2, dtype=torch.int32),
                               torch.arange(N) * 7919 + 3, torch.full((N,), 11))
    def pvalue(tokens, want):
        return chi_square_pvalue(torch.bincount(tokens, minlength=V), want)
    assert pvalue(out.tokens[:, 0], p[0]) > 0.001
    assert pvalue(out.tokens[out.num_accepted >= 1, 1], p[1]) > 0.001
    assert pvalue(ids[:, 0], p[0]) < 1e-6            # the draft alone fails the same test
    assert 0.3 < out.num_accepted.float().mean() < 1.5
