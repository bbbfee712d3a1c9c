"""Sampling: Philox known answers, kernel == reference bit for bit, and the reference's
statistics over 1e5 draws."""
import math

import pytest
import torch

from pagedecode.kernels.penalties import PenaltyState, apply_penalties_ref, make_penalty_inputs
from pagedecode.kernels import philox
from pagedecode.kernels.philox import DRAFT_STREAM, gumbel, philox4x32, seed_to_int64, uniform
from pagedecode.kernels.sampling import make_sampling_inputs, sample, sample_ref, sampling_probs

from .conftest import DEVICE, needs_triton


def inputs(rows, **kw):
    cols = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, index=0)
    per = [{**cols, **kw, **r} for r in rows]
    return make_sampling_inputs([r["temperature"] for r in per], [r["top_k"] for r in per],
                                [r["top_p"] for r in per], [r["min_p"] for r in per],
                                [seed_to_int64(r["seed"]) for r in per], [r["index"] for r in per])


def test_philox_known_answers():
    """Random123's published Philox4x32-10 vectors."""
    def run(ctr, key):
        return [int(x) for x in philox4x32([torch.tensor(c) for c in ctr], [torch.tensor(k) for k in key])]
    assert run((0, 0, 0, 0), (0, 0)) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert run((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    assert run((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)) == \
        [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


@pytest.mark.skipif(philox._COMPILED is None, reason="pagedecode._cpu (with philox_c0) is not built")
def test_the_compiled_philox_is_the_torch_philox():
    """csrc/philox.h against the torch definition: seeds across all 64 bits (negative int64s),
    indices and tokens past 32 bits (their low words count), both streams, broadcast shapes."""
    g = torch.Generator().manual_seed(0)
    n = 10_000
    seed = torch.randint(-2**63, 2**63 - 1, (n,), generator=g)
    index = torch.randint(0, 2**40, (n,), generator=g)
    token = torch.randint(0, 2**33, (n,), generator=g)
    for stream in (0, DRAFT_STREAM, 2**32 + 5):
        assert torch.equal(philox.philox_c0(seed, index, token, stream),
                           philox.philox_c0_torch(seed, index, token, stream))
    one_seed, tokens = torch.tensor(seed_to_int64(2**64 - 1)), torch.arange(20_000)
    assert torch.equal(philox.philox_c0(one_seed, torch.tensor(3), tokens),
                       philox.philox_c0_torch(one_seed, torch.tensor(3), tokens))
    assert torch.equal(philox.philox_c0(torch.tensor([0]), torch.tensor([0]), torch.tensor([0], dtype=torch.int32)),
                       philox.philox_c0_torch(torch.tensor([0]), torch.tensor([0]), torch.tensor([0])))


def test_uniform_never_hits_zero_or_one_and_is_uniform():
    u = uniform(torch.tensor(12345), torch.arange(200_000), torch.tensor(7))
    assert u.min() > 0 and u.max() < 1
    counts = torch.histc(u, bins=10, min=0, max=1)
    chi2 = ((counts - 20_000) ** 2 / 20_000).sum().item()
    assert chi2 < 27.9          # 9 degrees of freedom, p = 0.001
    g = gumbel(torch.tensor(1), torch.arange(200_000), torch.tensor(0))
    assert abs(g.mean().item() - 0.5772) < 0.01    # Euler-Mascheroni


ROW_SETTINGS = [
    dict(temperature=0.0),
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=10),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=0.9, top_k=5, top_p=0.9, min_p=0.1),
    dict(temperature=1.0, top_p=0.5, seed=2**64 - 1),
    dict(temperature=1.0, top_k=1000),          # k >= vocab: no filtering
    dict(temperature=2.0, min_p=0.3, seed=2**63),
]


@needs_triton
@pytest.mark.parametrize("vocab", [111, 300])
def test_kernel_matches_reference_bit_for_bit(vocab):
    g = torch.Generator().manual_seed(vocab)
    rows = [dict(s, seed=s.get("seed", i * 7919), index=i * 3) for i, s in enumerate(ROW_SETTINGS)]
    logits = torch.randn(len(rows), vocab, generator=g) * 3
    logits[1, :20] = float("-inf")                  # -inf tokens are never drawn
    logits[3, 5] = logits[3, 9] = logits[3].max() + 1   # a tie at the top
    inp = inputs(rows)
    ref = sample_ref(logits, inp)
    out = sample(logits.to(DEVICE), inp.to(DEVICE), backend="triton")
    assert out.tokens.cpu().tolist() == ref.tokens.tolist()
    torch.testing.assert_close(out.logprobs.cpu(), ref.logprobs, atol=1e-5, rtol=1e-5)
    assert ref.tokens[0] == logits[0].argmax()
    assert ref.tokens[1] >= 20


@needs_triton
def test_kernel_agrees_across_many_draws():
    """Same decisions over 32 output indices of one row, with filtering that cuts mid-ties."""
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(1, 200, generator=g) * 2).round().repeat(32, 1)   # many exact ties
    rows = [dict(temperature=0.8, top_k=12, top_p=0.7, seed=99, index=i) for i in range(32)]
    inp = inputs(rows)
    got = sample(logits.to(DEVICE), inp.to(DEVICE), backend="triton").tokens.cpu()
    assert got.tolist() == sample_ref(logits, inp).tokens.tolist()


@needs_triton
def test_kernel_paths_radix_select_compaction_and_fallback():
    """Each path of the kernel against the reference: the k-th value by radix select (negative
    values, ties, -inf), survivors finished in registers (via top-k, via min-p alone), and more
    survivors than the register tile (top-k 50) falling back to passes over the row."""
    g = torch.Generator().manual_seed(33)
    V = 300
    logits = torch.randn(8, V, generator=g) * 2 - 3                 # mostly negative
    logits[1] = (logits[1] * 2).round()                             # heavy ties
    logits[2, ::3] = float("-inf")
    rows = [dict(top_k=3, top_p=0.9), dict(top_k=7, top_p=0.6), dict(top_k=40, top_p=0.95),
            dict(top_k=50, top_p=0.9), dict(min_p=0.2, top_p=0.8), dict(min_p=0.001, top_p=0.9),
            dict(top_k=1, top_p=0.5), dict(top_k=299, top_p=0.99)]
    for n in range(4):
        inp = inputs([dict(r, seed=100 + i, index=n, temperature=0.9) for i, r in enumerate(rows)])
        got = sample(logits.to(DEVICE), inp.to(DEVICE), backend="triton").tokens.cpu()
        assert got.tolist() == sample_ref(logits, inp).tokens.tolist()


def test_greedy_is_first_argmax():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [0.0, -1.0, 0.0, 0.0]])
    out = sample_ref(logits, inputs([{}, {}], temperature=0.0))
    assert out.tokens.tolist() == [1, 0]
    torch.testing.assert_close(out.logprobs, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])


def test_tiny_temperature_is_greedy_not_nan():
    logits = torch.tensor([[29.0, 30.0, 10.0, -5.0]]).repeat(3, 1)
    out = sample_ref(logits, inputs([dict(top_k=2), {}, dict(top_p=0.5)], temperature=1e-30))
    assert out.tokens.tolist() == [1, 1, 1] and torch.isfinite(out.logprobs).all()


def test_filters_that_leave_one_token_are_greedy():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(8, 64, generator=g) * 3
    want = logits.argmax(-1)
    for kw in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)):
        out = sample_ref(logits, inputs([dict(index=i, seed=i) for i in range(8)], temperature=1.5, **kw))
        assert torch.equal(out.tokens, want), kw


def _frequencies(logits_row, n, **kw):
    rows = [dict(index=i, seed=424242) for i in range(n)]
    out = sample_ref(logits_row.repeat(n, 1), inputs(rows, **kw))
    return torch.bincount(out.tokens, minlength=logits_row.numel()).double() / n


def _chi2_ok(freq, expected, n):
    keep = expected > 0
    assert freq[~keep].sum() == 0, "a token with zero probability was drawn"
    chi2 = (n * (freq[keep] - expected[keep]) ** 2 / expected[keep]).sum().item()
    dof = int(keep.sum()) - 1
    return chi2 < dof + 5 * math.sqrt(2 * dof) + 10


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_temperature_statistics(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, float("-inf"), 1.5])
    n = 100_000
    freq = _frequencies(logits, n, temperature=temperature)
    expected = torch.softmax(logits.double() / temperature, -1)
    assert _chi2_ok(freq, expected, n)
    cos = torch.nn.functional.cosine_similarity(freq, expected, dim=0)
    assert cos > 0.999


def test_top_k_top_p_min_p_statistics():
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -0.5, -2.0])
    n = 100_000
    p = torch.softmax(logits.double(), -1)
    # top-k 5 then top-p 0.8 over the renormalised five: the smallest prefix reaching 0.8
    p5 = p[:5] / p[:5].sum()
    keep = int((p5.cumsum(0) < 0.8).sum()) + 1
    expected = torch.zeros(8, dtype=torch.float64)
    expected[:keep] = p[:keep] / p[:keep].sum()
    assert _chi2_ok(_frequencies(logits, n, top_k=5, top_p=0.8), expected, n)
    # min-p 0.2: tokens with p >= 0.2 * p_max
    kept = p >= 0.2 * p.max()
    expected = torch.where(kept, p, 0.0)
    assert _chi2_ok(_frequencies(logits, n, min_p=0.2), expected / expected.sum(), n)


def test_sampling_probs_is_the_distribution_sample_draws_from():
    """sampling_probs (speculation's p and q) equals the filtered softmax the statistics above
    check the draws against, and the draws' frequencies; a greedy row is one-hot."""
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -0.5, -2.0])
    p = torch.softmax(logits.double(), -1)
    p5 = p[:5] / p[:5].sum()
    keep = int((p5.cumsum(0) < 0.8).sum()) + 1
    top = torch.zeros(8, dtype=torch.float64)
    top[:keep] = p[:keep] / p[:keep].sum()
    min_p = torch.where(p >= 0.2 * p.max(), p, 0.0)
    hot = torch.softmax(logits.double() / 0.5, -1)
    rows = [dict(top_k=5, top_p=0.8), dict(min_p=0.2), dict(temperature=0.5), dict(temperature=0.0)]
    got = sampling_probs(logits.repeat(4, 1), inputs(rows))
    want = torch.stack([top, min_p / min_p.sum(), hot, torch.eye(8, dtype=torch.float64)[0]]).float()
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.equal(got == 0, want == 0)               # exactly the tokens sample can draw
    n = 100_000
    assert _chi2_ok(_frequencies(logits, n, top_k=5, top_p=0.8), got[0].double(), n)


def test_the_draft_stream_is_another_stream():
    seed, index, token = torch.tensor(12345), torch.arange(64), torch.tensor(7)
    assert torch.equal(uniform(seed, index, token, 0), uniform(seed, index, token))
    assert not torch.equal(uniform(seed, index, token, DRAFT_STREAM), uniform(seed, index, token))


def test_ties_at_the_threshold_are_kept():
    logits = torch.tensor([[5.0, 1.0, 1.0, 1.0, 0.0]]).repeat(4000, 1)
    rows = [dict(top_k=2, index=i) for i in range(4000)]
    drawn = set(sample_ref(logits, inputs(rows)).tokens.tolist())
    assert drawn == {0, 1, 2, 3}            # k = 2 keeps every token equal to the 2nd largest


def test_top_p_one_and_k_at_least_vocab_change_nothing():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1)).repeat(300, 1)
    base = [dict(index=i, seed=5) for i in range(300)]
    a = sample_ref(logits, inputs(base)).tokens
    b = sample_ref(logits, inputs(base, top_k=50, top_p=1.0)).tokens
    c = sample_ref(logits, inputs(base, top_k=10_000)).tokens
    assert torch.equal(a, b) and torch.equal(a, c)


def test_same_seed_and_index_same_token_in_any_batch_order():
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(16, 97, generator=g)
    rows = [dict(seed=1000 + i, index=i % 5, top_k=(i % 3) * 7, top_p=0.9) for i in range(16)]
    out = sample_ref(logits, inputs(rows)).tokens
    perm = torch.randperm(16, generator=g)
    out_perm = sample_ref(logits[perm], inputs([rows[i] for i in perm.tolist()])).tokens
    assert torch.equal(out[perm], out_perm)
    alone = [sample_ref(logits[i:i + 1], inputs([rows[i]])).tokens.item() for i in range(16)]
    assert alone == out.tolist()


def test_pruned_noise_is_exact():
    """The reference draws noise only for tokens that can still win; a brute force that draws
    it for every token must choose the same."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(64, 400, generator=g) * 8          # wide spread: most tokens pruned
    rows = [dict(seed=77, index=i, temperature=1.0) for i in range(64)]
    inp = inputs(rows)
    got = sample_ref(logits, inp).tokens
    noise = gumbel(inp.seed[:, None], inp.output_index[:, None], torch.arange(400)[None, :])
    assert torch.equal(got, (logits + noise).argmax(-1))


def test_penalties_and_bias():
    state = PenaltyState(num_slots=3, vocab_size=5, device="cpu")
    state.reset(1, prompt_ids=[0], output_ids=[1, 2], logit_bias={4: 10.0})
    state.record([1], [2])                                   # output is now [1, 2, 2]
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 0.0], [2.0, -2.0, 1.0, 0.5, 0.0]])
    pen = make_penalty_inputs(state, [1, 0], [2.0, 1.0], [0.5, 0.0], [0.25, 0.0], [1, 0], "cpu")
    out = apply_penalties_ref(logits, pen)
    # 0: in the prompt, positive -> /2; 1: output once, negative -> *2, then -0.25 -0.5;
    # 2: output twice -> /2, then -0.5 -0.5; 3: untouched; 4: +10 bias
    torch.testing.assert_close(out[0], torch.tensor([1.0, -4.75, -0.5, 0.5, 10.0]))
    assert torch.equal(out[1], logits[1])                     # an inactive row is left alone
    state.reset(1, prompt_ids=[3], output_ids=[], logit_bias=None)    # a new owner: clean row
    assert state.counts[1].sum() == 0 and state.seen[1].tolist() == [0, 0, 0, 1, 0] and state.bias[1].abs().sum() == 0


@needs_triton
def test_kernel_applies_penalties_exactly_as_the_reference():
    g = torch.Generator().manual_seed(21)
    B, V = 6, 150
    logits = torch.randn(B, V, generator=g) * 3
    state = PenaltyState(8, V, "cpu")
    for slot in range(8):
        ids = torch.randint(0, V, (12,), generator=g).tolist()
        state.reset(slot, ids[:6], ids[6:], {int(ids[0]): 4.0, int(ids[1]): float("-inf")})
    pen = make_penalty_inputs(state, [7, 3, 0, 5, 1, 2], [1.5, 1.0, 0.7, 1.2, 1.0, 2.0], [0.5, 0, -1.0, 0, 2.0, 0],
                              [0.3, 0, 0.5, 1.0, 0, 0], [1, 0, 1, 1, 1, 1], "cpu")
    inp = inputs([dict(temperature=0.0), dict(), dict(top_k=7), dict(top_p=0.8), dict(temperature=0.0),
                  dict(min_p=0.05, index=9)])
    ref = sample_ref(logits, inp, pen)
    out = sample(logits.to(DEVICE), inp.to(DEVICE), backend="triton", penalties=_to(pen, DEVICE))
    assert out.tokens.cpu().tolist() == ref.tokens.tolist()
    torch.testing.assert_close(out.logprobs.cpu(), ref.logprobs, atol=1e-5, rtol=1e-5)
    assert ref.tokens[0] == apply_penalties_ref(logits, pen)[0].argmax()


def _to(pen, device):
    st = PenaltyState(pen.state.counts.shape[0], pen.state.vocab_size, device)
    st.counts.copy_(pen.state.counts)
    st.seen.copy_(pen.state.seen)
    st.bias.copy_(pen.state.bias)
    return make_penalty_inputs(st, pen.slot.tolist(), pen.repetition.tolist(), pen.presence.tolist(),
                               pen.frequency.tolist(), pen.active.tolist(), device)


@needs_triton
@pytest.mark.parametrize("temperature, top_k, top_p", [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.8, 5, 0.9), (1.2, 0, 0.5)])
def test_a_row_with_nothing_allowed_gets_a_nan_logprob_on_both_paths(temperature, top_k, top_p):
    """Bias -inf on every id, a bias that bans the only finite logit (min_tokens masked the
    rest), a grammar mask that allows only banned ids: no token is allowed, and both paths say so
    with a NaN logprob (the selector fails such a row); the other rows are untouched."""
    g = torch.Generator().manual_seed(19)
    B, V = 5, 111
    logits = torch.randn(B, V, generator=g) * 3
    logits[2] = float("-inf")
    logits[2, 17] = 1.0                               # only 17 is finite (as if min_tokens masked EOS)
    state = PenaltyState(B, V, "cpu")
    state.reset(0, [1], [], {t: float("-inf") for t in range(V)})
    state.reset(1, [1], [2], {7: 1.0})
    state.reset(2, [1], [], {17: float("-inf")})
    state.reset(3, [1], [], {t: float("-inf") for t in range(0, V, 2)})     # even ids banned
    state.reset(4, [], [], None)
    mask = torch.full((B, -(-V // 32)), -1, dtype=torch.int32)
    mask[3] = 0x55555555                              # the grammar allows only even ids
    pen = make_penalty_inputs(state, list(range(B)), [1.1] * B, [0.2] * B, [0.0] * B, [1, 1, 1, 1, 0], "cpu")
    inp = inputs([dict(index=i) for i in range(B)], temperature=temperature, top_k=top_k, top_p=top_p, seed=4)
    ref = sample_ref(logits, inp, pen, mask)
    out = sample(logits.to(DEVICE), inp.to(DEVICE), backend="triton", penalties=_to(pen, DEVICE),
                 bitmask=mask.to(DEVICE))
    for res in (ref, out):
        lp = res.logprobs.cpu()
        assert [bool(torch.isnan(lp[i])) for i in range(B)] == [True, False, True, True, False]
    assert out.tokens.cpu()[[1, 4]].tolist() == ref.tokens[[1, 4]].tolist()
    torch.testing.assert_close(out.logprobs.cpu()[[1, 4]], ref.logprobs[[1, 4]], atol=1e-5, rtol=1e-5)


@needs_triton
def test_kernel_processed_rows_and_slot_settings_equal_the_reference():
    """The processed rows the kernel writes in its first pass (penalties, bias, grammar mask),
    which the selector takes top logprobs from, equal the torch reference's bit for bit, and so
    do the top logprobs; settings read through each row's slot (the engine keeps one entry per
    batch slot) choose what the same settings given per row choose; one caller-owned scratch
    serves calls of any batch size."""
    from pagedecode.kernels.sampling import SamplerScratch, SamplingInputs
    g = torch.Generator().manual_seed(29)
    B, V, slots = 5, 150, [5, 0, 3, 1, 2]
    logits = torch.randn(B, V, generator=g) * 3
    state = PenaltyState(6, V, "cpu")
    for slot in range(6):
        ids = torch.randint(0, V, (10,), generator=g).tolist()
        state.reset(slot, ids[:5], ids[5:], {int(ids[0]): 3.0, int(ids[1]): float("-inf")})
    pen = make_penalty_inputs(state, slots, [1.3, 1.0, 0.8, 1.5, 1.1], [0.4, 0.0, -0.5, 0.0, 1.0],
                              [0.2, 0.0, 0.3, 1.0, 0.0], [1, 1, 0, 1, 1], "cpu")
    mask = torch.randint(-2**31, 2**31 - 1, (B, -(-V // 32)), generator=g, dtype=torch.int64).to(torch.int32)
    mask[2] = -1                                            # one unconstrained row
    per_row = [dict(temperature=0.0), dict(top_k=7, seed=3, index=4), dict(top_p=0.8, seed=9, index=1),
               dict(min_p=0.05, temperature=0.7, index=2), dict(temperature=1.3, top_k=3, top_p=0.9, index=8)]
    rows = inputs(per_row)
    # the same settings kept per slot (slot 4 holds a request not in this batch)
    at = torch.tensor(slots)
    by_slot = SamplingInputs(*(torch.zeros(6, dtype=t.dtype).index_copy_(0, at, t) for t in
                               (rows.temperature, rows.top_k, rows.top_p, rows.log_min_p, rows.seed)),
                             output_index=rows.output_index, slot=at)
    scratch = SamplerScratch()
    for penalties, bitmask in ((pen, mask), (pen, None), (None, mask), (None, None)):
        ref = sample_ref(logits, rows, penalties, bitmask)
        out = sample(logits.to(DEVICE), by_slot.to(DEVICE), backend="triton",
                     penalties=None if penalties is None else _to(penalties, DEVICE),
                     bitmask=None if bitmask is None else bitmask.to(DEVICE), scratch=scratch)
        assert out.tokens.cpu().tolist() == ref.tokens.tolist()
        assert torch.equal(out.processed.cpu(), ref.processed)
        want = torch.log_softmax(ref.processed, -1).topk(6, dim=-1)
        got = torch.log_softmax(out.processed.cpu(), -1).topk(6, dim=-1)
        assert torch.equal(got.indices, want.indices) and torch.equal(got.values, want.values)
    one = sample(logits[:1].to(DEVICE), inputs(per_row[:1]).to(DEVICE), backend="triton", bitmask=mask[:1].to(DEVICE),
                 scratch=scratch)                           # a smaller batch reuses the buffers
    assert one.tokens.item() == sample_ref(logits[:1], inputs(per_row[:1]), None, mask[:1]).tokens.item()
