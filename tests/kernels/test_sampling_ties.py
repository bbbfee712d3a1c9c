"""Ties broken one way on every path (issue 38, deterministic mode): the Triton sampler, as the
torch reference, picks the lower token id among equal maxima (greedy: within a vocab tile,
across tiles, after a grammar mask), and top-k keeps every token equal to its k-th value (the
sampler's rule on both paths: a cut through the ties would keep the ids the kernel met first).
Top logprobs' rule (the lower id first) is runtime/selector.top_n's, tested in
tests/runtime/test_selector.py. In the interpreter, tiles are 64 tokens and a tile keeps 8
candidates, so V = 300 crosses five tiles and a tie of 12 in one tile overflows its candidates."""
import pytest
import torch

from pagedecode.kernels.sampling import sample, sample_ref

from .conftest import DEVICE, needs_triton
from .test_sampling import inputs

V = 300


def tied_row(ids, value=5.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    row = torch.randn(V, generator=g)              # all below `value`
    row[list(ids)] = value
    return row


# (the tied ids in the order written, the lower one that must win)
GREEDY_TIES = [
    ((250, 70, 130), 70),          # across tiles, the lowest not in the first tile
    ((9, 5), 5),                   # within one tile
    ((299, 290), 290),             # in the last, partial tile
    ((64, 63), 63),                # either side of a tile boundary
    (tuple(range(V)), 0),          # every token equal
]


@needs_triton
def test_greedy_takes_the_lower_id_among_equal_maxima():
    logits = torch.stack([tied_row(ids, seed=i) for i, (ids, _) in enumerate(GREEDY_TIES)])
    inp = inputs([{}] * len(GREEDY_TIES), temperature=0.0)
    want = [w for _, w in GREEDY_TIES]
    assert sample_ref(logits, inp).tokens.tolist() == want
    assert sample(logits.to(DEVICE), inp.to(DEVICE), backend="triton").tokens.cpu().tolist() == want


@needs_triton
def test_greedy_under_a_mask_takes_the_lower_allowed_id():
    """The grammar's mask removes the lowest of the tied ids: the next lower one wins (the
    processed row the kernel writes, read by its last pass)."""
    logits = tied_row((250, 70, 130))[None, :]
    bitmask = torch.full((1, -(-V // 32)), -1, dtype=torch.int32)      # every token allowed ...
    bitmask[0, 70 // 32] &= ~(1 << (70 % 32))                          # ... but 70
    inp = inputs([{}], temperature=0.0)
    assert sample_ref(logits, inp, bitmask=bitmask).tokens.tolist() == [130]
    out = sample(logits.to(DEVICE), inp.to(DEVICE), backend="triton", bitmask=bitmask.to(DEVICE))
    assert out.tokens.cpu().tolist() == [130]


@needs_triton
@pytest.mark.parametrize("ties, k, above", [
    ((40, 100, 170, 230, 299), 3, True),     # the 3rd value tied five ways, one id per tile
    (tuple(range(130, 142)), 2, True),       # twelve ties in one tile: past its 8 candidates
    (tuple(range(0, 300, 25)), 12, False),   # k equal to the ties: all of them, exactly
])
def test_top_k_keeps_every_token_tied_with_the_kth_value(ties, k, above):
    """Top-k's kept set is every token >= the k-th value, so the highest ids tied with it are
    drawn too (a cut through the ties, lower ids first, would never draw them). The reference
    finds draws of the highest and the lowest tied id (the interpreter is slow: the kernel runs
    only those rows); the kernel draws the same tokens."""
    row = torch.full((V,), -4.0)
    row[list(ties)] = 2.0
    if above:
        row[7] = 2.5                          # one above the ties: k > 1 reaches into them
    settings = [dict(index=i, seed=17, top_k=k, temperature=1.0) for i in range(256)]
    drawn = sample_ref(row.repeat(256, 1), inputs(settings)).tokens.tolist()
    assert set(drawn) == set(ties) | ({7} if above else set()), "the reference keeps every tie"
    rows = [drawn.index(max(ties)), drawn.index(min(ties))]
    inp = inputs([settings[i] for i in rows])
    got = sample(row.repeat(2, 1).to(DEVICE), inp.to(DEVICE), backend="triton").tokens.cpu().tolist()
    assert got == [max(ties), min(ties)], "the kernel cut ties at the k-th value"
