"""The vocab-tiled sampler (sampling_kernels.py's three kernels) in the interpreter, where a tile is 64
tokens and a tile keeps 8 top-k candidates: every path against the reference token for token,
the kernel's own draws against the exact distribution (chi-square), and a request's token the
same alone, in a batch, in any order."""
import math

import pytest
import torch

from pagedecode.kernels.philox import seed_to_int64
from pagedecode.kernels.sampling import (TILE_CANDIDATES_INTERPRETED, make_sampling_inputs, sample, sample_ref,
                                         sampling_probs)

from .conftest import DEVICE, needs_triton

pytestmark = needs_triton


def inputs(rows):
    cols = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, index=0)
    per = [{**cols, **r} for r in rows]
    return make_sampling_inputs([r["temperature"] for r in per], [r["top_k"] for r in per],
                                [r["top_p"] for r in per], [r["min_p"] for r in per],
                                [seed_to_int64(r["seed"]) for r in per], [r["index"] for r in per])


K = TILE_CANDIDATES_INTERPRETED
# each path of the finish kernel: tile candidates (k <= K, with and without top-p / min-p), the
# tiles' draws (temperature, min-p), the row fallback (top-p alone, k > K), greedy
PATHS = [dict(temperature=0.7, top_k=3), dict(temperature=1.1, top_k=K, top_p=0.8),
         dict(temperature=0.9, top_k=5, top_p=0.9, min_p=0.05), dict(temperature=1.0, top_k=1),
         dict(temperature=1.0), dict(temperature=1.5, min_p=0.2), dict(temperature=1.2, top_p=0.6),
         dict(temperature=0.8, top_k=K + 9, top_p=0.95), dict(temperature=0.0), dict(temperature=1.0, top_k=10_000)]


@pytest.mark.parametrize("vocab", [63, 64, 333])      # one partial tile, one full tile, six tiles
def test_every_path_gives_the_reference_token(vocab):
    g = torch.Generator().manual_seed(vocab)
    rows = [dict(r, seed=17 * i + 3, index=i) for i, r in enumerate(PATHS)]
    logits = torch.randn(len(rows), vocab, generator=g) * 2.5
    logits[4, ::2] = float("-inf")
    inp = inputs(rows)
    ref = sample_ref(logits, inp)
    out = sample(logits.to(DEVICE), inp.to(DEVICE), backend="triton")
    assert out.tokens.cpu().tolist() == ref.tokens.tolist()
    torch.testing.assert_close(out.logprobs.cpu(), ref.logprobs, atol=1e-5, rtol=1e-5)


def test_ties_past_a_tiles_candidates_take_the_row_path():
    """A tile with more tokens tied at its K-th value than it keeps: when those ties reach the
    k-th value the tile's candidates are not the whole kept set, and the row path decides;
    below the k-th value they cannot matter and the candidates decide. Both give the reference."""
    V = 200
    g = torch.Generator().manual_seed(4)
    base = torch.randn(V, generator=g)
    at_top = base.clone()
    at_top[3:3 + 3 * K] = base.max() + 1           # 3K tokens tied at the top, all in tile 0
    below = base.clone()
    below[70:70 + 3 * K] = base.min() - 1          # 3K ties at the bottom of tile 1
    logits = torch.stack([at_top] * 4 + [below] * 4)
    rows = [dict(top_k=k, top_p=p, seed=5, index=i, temperature=0.9)
            for i, (k, p) in enumerate([(2, 1.0), (K, 0.7), (4, 0.9), (1, 1.0)] * 2)]
    inp = inputs(rows)
    ref = sample_ref(logits, inp).tokens
    assert sample(logits.to(DEVICE), inp.to(DEVICE), backend="triton").tokens.cpu().tolist() == ref.tolist()
    assert set(ref[:4].tolist()) <= set(range(3, 3 + 3 * K))        # a tied top token, as it should be


def chi2_p_value_ok(counts: torch.Tensor, probs: torch.Tensor, n: int) -> bool:
    """Pearson's chi-square over the categories expected at least 5 times (the rest pooled), at
    p = 0.001; and no draw where the probability is 0."""
    if bool((counts[probs == 0] > 0).any()):
        return False
    expected = probs.double() * n
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = (((obs - exp) ** 2)[keep] / exp[keep]).sum().item()
    dof = int(keep.sum()) - 1
    # Wilson-Hilferty: the chi-square quantile at 1 - 0.001 (z = 3.09)
    limit = dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3
    return stat < limit


SETTINGS = [
    dict(temperature=0.9, top_k=6, top_p=0.8, min_p=0.05),   # the tiles' candidates
    dict(temperature=1.3, min_p=0.1),                        # the tiles' draws
    dict(temperature=1.0, top_p=0.7),                        # the row path
]


def kernel_draws(settings, n, V=40):
    """n draws by the kernel itself from one row (one output index each), with the row's exact
    distribution and the reference's tokens for the same seeds and indices."""
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(V, generator=g) * 1.5).repeat(n, 1)
    inp = inputs([dict(settings, seed=77, index=i) for i in range(n)])
    tokens = sample(logits.to(DEVICE), inp.to(DEVICE), backend="triton").tokens.cpu()
    probs = sampling_probs(logits[:1], inputs([dict(settings, seed=77)]))[0]
    return tokens, probs, sample_ref(logits, inp).tokens


@pytest.mark.parametrize("settings", SETTINGS)
def test_the_kernels_draws_are_the_references_over_many_indices(settings):
    """60 draws on each of the kernel's three paths equal the reference's token for token; the
    reference's own statistics are tested over 1e5 draws in test_sampling.py."""
    tokens, probs, ref = kernel_draws(settings, 60)
    assert tokens.tolist() == ref.tolist()
    assert len(set(tokens.tolist())) > 3 and int((probs > 0).sum()) > 3     # draws, not a point mass


@pytest.mark.slow
@pytest.mark.parametrize("settings", SETTINGS)
def test_the_kernels_draws_follow_the_distribution(settings):
    """200 draws by the kernel on each path against sampling_probs' exact distribution
    (chi-square; 40 tokens, the interpreter's budget). Slow (25 s a path in the interpreter): the
    test above ties the kernel to the reference draw for draw."""
    n = 200
    tokens, probs, _ = kernel_draws(settings, n)
    assert chi2_p_value_ok(torch.bincount(tokens, minlength=probs.numel()), probs, n)
    assert int((probs > 0).sum()) > 3                # a test of a distribution, not of a point mass


def test_a_requests_token_is_the_same_alone_in_a_batch_and_in_any_order():
    g = torch.Generator().manual_seed(12)
    V = 150
    rows = [dict(r, seed=1000 + i, index=i % 3) for i, r in enumerate(PATHS)]
    logits = torch.randn(len(rows), V, generator=g) * 2
    inp = inputs(rows).to(DEVICE)
    batch = sample(logits.to(DEVICE), inp, backend="triton").tokens.cpu()
    perm = torch.randperm(len(rows), generator=g)
    shuffled = sample(logits[perm].to(DEVICE), inputs([rows[i] for i in perm.tolist()]).to(DEVICE),
                      backend="triton").tokens.cpu()
    assert torch.equal(batch[perm], shuffled)
    for i in (0, 1, 4, 6, 8):
        alone = sample(logits[i:i + 1].to(DEVICE), inputs([rows[i]]).to(DEVICE), backend="triton").tokens.item()
        assert alone == batch[i].item()


def test_rows_of_a_wider_tensor():
    """Logits whose rows lie further apart than the vocabulary (a column slice): every pass reads
    the row it should (they are made contiguous first)."""
    g = torch.Generator().manual_seed(8)
    wide = torch.randn(3, 100, generator=g) * 2
    logits = wide[:, :70]
    rows = [dict(temperature=0.8, top_k=4, seed=1), dict(temperature=1.0, seed=2), dict(temperature=0.0)]
    inp = inputs(rows)
    out = sample(logits.to(DEVICE), inp.to(DEVICE), backend="triton")
    assert out.tokens.cpu().tolist() == sample_ref(logits.contiguous(), inp).tokens.tolist()
