"""The token selector (runtime/selector.py): per-slot sampling state on the device, so a steady
decode step copies only the batch to it; top logprobs from the sampler's processed rows."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import pagedecode as pd
from pagedecode.kernels._backend import HAS_TRITON, interpreting

P = pd.SamplingParams


class HostToDevice(TorchDispatchMode):
    """Counts what a step sends from the host to `device`: tensors made from host data there
    (torch.tensor(...), lift_fresh: on CUDA each is a copy) and copies from a CPU tensor to it
    (on CUDA the batch is made on the host, then copied). On a CPU engine nothing is copied for
    real: every tensor made from host data counts, which is what a CUDA step would copy."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.copies: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name == "lift_fresh" and out.device == self.device:
            self.copies.append(f"{name} {tuple(out.shape)}")
        elif self.device.type != "cpu" and name in ("_to_copy", "copy_") and isinstance(out, torch.Tensor):
            source = args[1] if name == "copy_" else src
            if isinstance(source, torch.Tensor) and source.device.type == "cpu" and out.device == self.device:
                self.copies.append(f"{name} {tuple(source.shape)}")
        return out


# every sampling input at once: seeded top-k / top-p / min-p, penalties and bias, top logprobs,
# a greedy row and a plain sampled one
STEADY = [P(max_tokens=64, ignore_eos=True, temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, seed=1, logprobs=3,
            repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.1, logit_bias={5: 1.5}),
          P(max_tokens=64, ignore_eos=True, temperature=0.0, logprobs=2),
          P(max_tokens=64, ignore_eos=True, temperature=1.0, seed=3)]


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() and not interpreting() else []))
def test_a_steady_decode_step_copies_only_the_batch_to_the_device(stories_path, device):
    """Per-slot settings and penalty state are written at admission; a decode step sends only
    the batch (token ids, positions, slots, page table: two tensors, one per dtype). Each row's
    slot and output index ride in the batch's int64 tensor. Before: 2 + 6 sampling inputs + 5
    penalty inputs + 2 for recording the chosen tokens = 15 per step."""
    eng = pd.Engine.from_pretrained(stories_path, device=device, max_batch_size=4)
    ids = [eng.add_request(p, sp) for p, sp in zip(["Once upon a time", "Lily and Tom", "The cat"], STEADY)]
    def chosen():
        return [len(eng.result(r).selected_token_ids) for r in ids]
    while min(chosen()) < 2:                     # every prompt done: decode steps only from here
        eng.step()
    counted = []
    for _ in range(3):
        with HostToDevice(eng.device) as hook:
            eng.step()
        counted.append(hook.copies)
    assert min(chosen()) >= 5 and all(eng.result(r).state == pd.RequestState.DECODING for r in ids)
    assert all(len(c) <= 2 for c in counted), [(len(c), c) for c in counted]
    eng.shutdown()


def test_the_same_choices_after_preemption_and_slot_reuse(stories_engine_factory):
    """Settings live in the slot: a request that loses its slot (preempted) and gets another,
    and a slot reused by a request with other settings, choose exactly what they choose alone."""
    prompts = ["Once upon a time", "Lily and Tom", "The cat sat", "One day"]
    params = [P(max_tokens=40, ignore_eos=True, temperature=0.9, top_p=0.8, seed=11, logprobs=2,
                frequency_penalty=0.5),
              P(max_tokens=40, ignore_eos=True, temperature=0.0),
              P(max_tokens=40, ignore_eos=True, temperature=1.2, top_k=5, seed=12, repetition_penalty=1.4),
              P(max_tokens=40, ignore_eos=True, temperature=0.7, min_p=0.1, seed=13, logit_bias={7: 2.0})]
    alone = [stories_engine_factory().generate(p, sp)[0] for p, sp in zip(prompts, params)]
    # two slots and a pool small enough to preempt: slots are reused and requests move
    tight = stories_engine_factory(max_batch_size=2, max_cache_tokens=64, page_size=16, enable_prefix_caching=False)
    both = tight.generate(prompts, params)
    assert tight.scheduler.preemptions > 0
    for a, b in zip(alone, both):
        assert b.selected_token_ids == a.selected_token_ids
        assert b.logprobs == a.logprobs and b.top_logprobs == a.top_logprobs


@pytest.mark.skipif(not (HAS_TRITON and interpreting()), reason="needs the Triton interpreter")
def test_the_kernel_path_chooses_and_reports_what_the_reference_does(stories_engine_factory):
    """The engine on the Triton sampler (interpreted) against the torch reference: the same
    tokens, logprobs and top logprobs (taken from the kernel's processed rows: penalties, bias
    and the min_tokens mask applied once, in the kernel)."""
    prompts = ["Once upon a time", "Lily"]
    params = [P(max_tokens=4, ignore_eos=True, temperature=0.9, top_k=30, seed=5, logprobs=4,
                repetition_penalty=1.3, presence_penalty=0.5, logit_bias={10: 2.0, 11: -5.0}),
              P(max_tokens=4, temperature=0.0, logprobs=3, min_tokens=3)]
    ref = stories_engine_factory(sampling_backend="torch").generate(prompts, params)
    tri = stories_engine_factory(sampling_backend="triton").generate(prompts, params)
    for a, b in zip(ref, tri):
        assert b.selected_token_ids == a.selected_token_ids
        assert b.top_logprobs is not None and len(b.top_logprobs) == 4
        for ta, tb in zip(a.top_logprobs, b.top_logprobs):
            assert [t for t, _ in tb] == [t for t, _ in ta]
            assert [v for _, v in tb] == pytest.approx([v for _, v in ta], abs=1e-5)
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)


def test_greedy_rows_pick_what_torch_max_picks():
    """The greedy path's argmax (numpy's on CPU float32, torch's max elsewhere): the same index and
    value as torch.max per row, the first of tied maxima, NaN anywhere giving its position and NaN,
    +inf its position, a row of -inf index 0 and -inf; any layout, no rows."""
    import math

    from pagedecode.runtime.selector import greedy_rows
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 1000, generator=g)
    x[1, 7] = x[1, 900] = 50.0                       # a tie: the first
    x[2, 13] = float("nan")
    x[3, 500] = float("inf")
    x[4] = float("-inf")
    x[5, 3] = float("nan")
    x[5, 4] = float("inf")                           # NaN before +inf: the NaN
    for logits in (x, x[:, ::2], x.t().contiguous().t(), x.to(torch.bfloat16)):
        tokens, best = greedy_rows(logits)
        want_best, want_idx = logits.max(dim=-1)
        assert tokens == want_idx.tolist()
        for got, want in zip(best, want_best.float().tolist()):
            assert got == want or (math.isnan(got) and math.isnan(want))
    assert greedy_rows(x)[0][1:6] == [7, 13, 500, 0, 3]
    assert greedy_rows(x[:0]) == ([], [])


def test_top_n_breaks_ties_by_the_lower_id_whatever_the_batch():
    """Top logprobs at equal values (a bfloat16 model has many): the lower token id first, and
    the same ids for a row alone or among others, on either side of the cut."""
    from pagedecode.runtime.selector import top_n
    g = torch.Generator().manual_seed(7)
    row = torch.full((1, 600), -9.0)
    row[0, [408, 442, 17, 599]] = -3.277          # four-way tie
    row[0, 5] = -1.0
    want_v, want_i = top_n(row, 3)
    assert want_i.tolist() == [[5, 17, 408]]
    for _ in range(20):
        others = torch.randint(-20, 0, (5, 600), generator=g).float() / 4      # ties everywhere
        batch = torch.cat([others[:2], row, others[2:]])
        v, i = top_n(batch, 3)
        assert i[2].tolist() == [5, 17, 408] and torch.equal(v[2], want_v[0])
        for r in range(batch.shape[0]):          # every row: values descending, equal values by id
            pairs = list(zip((-v[r]).tolist(), i[r].tolist()))
            assert pairs == sorted(pairs)
            cut, got = v[r, -1], i[r].tolist()
            assert set(got) >= set((batch[r] > cut).nonzero()[:, 0].tolist())     # every larger one
            at_cut = (batch[r] == cut).nonzero()[:, 0].tolist()                  # ascending ids
            assert [j for j in got if j in at_cut] == at_cut[:sum(j in at_cut for j in got)]
