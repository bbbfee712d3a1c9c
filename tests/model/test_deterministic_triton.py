"""Deterministic mode on the Triton path (the CUDA forward: kernels/matmul.py for every projection
and the LM head, RMSNorm one row per program, extend attention in decode's order), run in the
interpreter on CPU: a sequence's logits at every position are the same bits whether its prompt
came in one prefill, in chunks beside other sequences, or token by token as decode steps.
On a CUDA machine (benchmarks/device_check.sh's tests step) the same test runs compiled."""
import random

import pytest
import torch

from pagedecode.kernels._backend import HAS_TRITON, interpreting
from pagedecode.model.batch import ForwardBatch
from pagedecode.model.kv_cache import KVCache

from ..kernels.conftest import needs_row_invariant_dot
from .test_cpu_extension import random_model

ON_GPU = torch.cuda.is_available() and not interpreting()
DEVICE = "cuda" if ON_GPU else "cpu"
pytestmark = pytest.mark.skipif(not HAS_TRITON or not (interpreting() or ON_GPU),
                                reason="needs triton (its interpreter on CPU, or CUDA)")

PAGE = 8


class Sequences:
    """Sequences over one KV cache, each with its own shuffled pages; `step` runs one forward of
    (name, tokens) pairs (one-token ones first, as the scheduler orders them) and returns each
    sequence's logits at every position it added."""

    def __init__(self, model, seed):
        self.model = model
        self.kv = KVCache(model.config.num_layers, 40, PAGE, model.config.num_kv_heads, model.config.head_dim,
                          model.dtype, device=DEVICE)
        self.free = list(range(40))
        random.Random(seed).shuffle(self.free)
        self.pages: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}

    def step(self, parts):
        ids, pos, slots, cu, lens, table = [], [], [], [0], [], []
        for name, tokens in parts:
            pages = self.pages.setdefault(name, [])
            c = self.cached.get(name, 0)
            while len(pages) * PAGE < c + len(tokens):
                pages.append(self.free.pop())
            for i, t in enumerate(tokens):
                ids.append(t)
                pos.append(c + i)
                slots.append(pages[(c + i) // PAGE] * PAGE + (c + i) % PAGE)
            cu.append(cu[-1] + len(tokens))
            lens.append(c + len(tokens))
            self.cached[name] = c + len(tokens)
        width = max(len(self.pages[n]) for n, _ in parts)
        table = [self.pages[n] + [-1] * (width - len(self.pages[n])) for n, _ in parts]
        num_decode = 0
        while num_decode < len(parts) and len(parts[num_decode][1]) == 1:
            num_decode += 1
        batch = ForwardBatch(torch.tensor(ids, device=DEVICE), torch.tensor(pos, device=DEVICE),
                             torch.tensor(slots, device=DEVICE), torch.tensor(table, dtype=torch.int32, device=DEVICE),
                             torch.tensor(lens, dtype=torch.int32, device=DEVICE),
                             torch.tensor(cu, dtype=torch.int32, device=DEVICE), torch.arange(len(ids), device=DEVICE),
                             num_decode=num_decode, max_new=max(len(t) for _, t in parts))
        logits = self.model.forward(batch, self.kv)
        return {name: logits[cu[s]:cu[s + 1]] for s, (name, _) in enumerate(parts)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_are_the_same_bits_however_the_prompt_is_batched_or_chunked(dtype):
    needs_row_invariant_dot()
    model = random_model(dtype, heads=4, kv_heads=2, head_dim=8, bias=True, device=DEVICE)
    model.attention_backend = "triton"
    model.deterministic = True
    rng = random.Random(3)
    needle = [rng.randrange(97) for _ in range(12)]
    other = [rng.randrange(97) for _ in range(12)]

    # alone: one prefill of the whole prompt
    alone = Sequences(model, 1).step([("n", needle)])["n"]

    # in chunks of 5, 4, a decode step and 2, beside other sequences' prefills and decode steps
    run = Sequences(model, 2)
    got = [run.step([("o", other[:5]), ("n", needle[:5])])["n"]]
    got.append(run.step([("o", other[5:6]), ("n", needle[5:9]), ("p", other[6:9])])["n"])
    got.append(run.step([("n", needle[9:10]), ("o", other[6:7]), ("p", other[9:12])])["n"])
    got.append(run.step([("o", other[7:8]), ("n", needle[10:])])["n"])
    chunked = torch.cat(got)

    # a prefix then decode steps (as after the prefix cache, or a recompute after preemption)
    run = Sequences(model, 3)
    got = [run.step([("n", needle[:10])])["n"]]
    for t in (10, 11):
        got.append(run.step([("o", other[t:t + 1]), ("n", needle[t:t + 1])])["n"])
    decoded = torch.cat(got)

    assert alone.shape == (12, 97) and torch.isfinite(alone).all()
    for p in range(12):
        assert torch.equal(alone[p], chunked[p]), f"position {p}: one prefill vs chunks in batches"
        assert torch.equal(alone[p], decoded[p]), f"position {p}: one prefill vs prefix + decode steps"
