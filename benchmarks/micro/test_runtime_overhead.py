"""The runtime's own cost per request-token: scheduling, batch building, token selection,
detokenizer, stop matching, events -- with a model double that costs (almost) nothing and checks
nothing (pd.testing.ScriptedModel verifies the whole cache on every forward; this one does not).

    make bench            (or: .venv/bin/python -m pytest benchmarks/micro -k runtime)

Goal (issue 9): <= 10 us per request-token at batch 256. Not part of `make test`.
"""
import gc

import pytest
import torch

import pagedecode as pd
from pagedecode.testing import ByteVocabTokenizer, ScriptedConfig

BATCH, PROMPT, OUTPUT = 256, 16, 64


class FreeModel:
    """pd.Model whose forward is one indexed fill: every sequence gets token 65 ('A')."""

    def __init__(self, vocab: int = 256) -> None:
        self.config = ScriptedConfig(vocab, 4096)
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self._logits = torch.full((BATCH * 2, vocab), -20.0)
        self._logits[:, 65] = 20.0

    def forward(self, batch, kv):
        return self._logits[: batch.logits_indices.shape[0]]


def make_engine():
    tok = ByteVocabTokenizer({i: bytes([i]) for i in range(256)})
    config = pd.EngineConfig(max_batch_size=BATCH, max_cache_tokens=BATCH * (PROMPT + OUTPUT + 16),
                             max_tokens_per_step=BATCH * PROMPT)    # default trace ("lifecycle")
    return pd.Engine(FreeModel(), tok, config)


@pytest.mark.parametrize("heap", ["default-gc", "frozen-heap"])
@pytest.mark.parametrize("stop", [[], ["zz"]], ids=["no-stop", "stop-string"])
def test_runtime_overhead_per_request_token(benchmark, stop, heap):
    """One round: 256 requests x 64 tokens through a whole generate (intake, every step, the
    results). "frozen-heap": after pd.freeze_heap(), as `pagedecode serve` runs; "default-gc":
    torch's ~170k objects are walked by every full collection (~100 ms each, one every ~2 rounds)."""
    engine = make_engine()
    prompts = [[66 + (i % 20)] * PROMPT for i in range(BATCH)]
    params = pd.SamplingParams(max_tokens=OUTPUT, ignore_eos=True, stop=stop)
    engine.generate(prompts[:4], params)                       # warm-up
    if heap == "frozen-heap":
        pd.freeze_heap()
    else:
        gc.collect()

    def run():
        outs = engine.generate(prompts, params)
        assert all(len(o.selected_token_ids) == OUTPUT for o in outs)

    try:
        benchmark.pedantic(run, rounds=8, iterations=1)
    finally:
        gc.unfreeze()
    tokens = BATCH * OUTPUT
    benchmark.extra_info["us_per_request_token_median"] = round(benchmark.stats.stats.median / tokens * 1e6, 2)
    benchmark.extra_info["us_per_request_token_mean"] = round(benchmark.stats.stats.mean / tokens * 1e6, 2)
    benchmark.extra_info["batch"] = BATCH
    print(f"\nruntime overhead ({benchmark.name}): median {benchmark.extra_info['us_per_request_token_median']}"
          f" us, mean {benchmark.extra_info['us_per_request_token_mean']} us per request-token at batch {BATCH}")
