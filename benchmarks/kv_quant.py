"""8-bit KV caches on SmolLM2-135M-Instruct (issue 40 item 7), CPU, compiled forward.

accuracy  8 chat prompts, each continued --tokens tokens greedily over a float32 cache; prompt and
          continuation then teacher-forced over each cache type (one prefill asking for every
          position's logits: each query attends over the K/V the cache holds, its own included, as
          a decode step would); mean KL(p_float32 cache || p_cache) over the continuation positions.
          Model: the Q4_1 file's weights dequantized to float32 (real_model.smollm2_f32_gguf).
capacity  bytes a token costs and the tokens a byte budget holds (the engine's pool for
          --budget-mb), per cache type, each as a multiple of float16's tokens (an 8-bit cache:
          head_dim bytes and a bfloat16 scale per layer, KV head and K / V: 1.94x at head_dim 64).
speed     decode tokens/s at --context tokens of context: one decode step (--batch rows, each over
          its own context) through model.forward, median of --steps, in --rounds rounds with the
          caches interleaved (each figure the median of its rounds, each ratio to float16 the
          median of the rounds' own ratios); the cache's contents are
          random (attention's cost does not depend on them). Model: the Q4_1 file (float32
          activations), whose weights are small enough that attention is a large part of a step.

    python benchmarks/kv_quant.py [--quick] [--out FILE]

Writes JSON (and a PNG beside it) under benchmarks/results/ (common.py).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pagedecode as pd  # noqa: E402
from pagedecode.model.batch import ForwardBatch  # noqa: E402
from pagedecode.model.kv_cache import KVCache  # noqa: E402
from pagedecode.testing import prefill_batch  # noqa: E402

CACHES = ("float32", "float16", "int8", "fp8_e4m3")
KL_BOUND = 1e-3
PROMPTS = [
    "What is the capital of France, and what is it famous for?",
    "Write a short poem about the sea.",
    "Explain how a refrigerator keeps food cold.",
    "Give me three tips for learning a new language.",
    "What is the difference between a virus and a bacterium?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "How do I make a cup of green tea?",
    "Why is the sky blue?",
]


def kv_dtype(name: str) -> torch.dtype:
    return pd.EngineConfig(kv_cache_dtype=name).kv_dtype(torch.float32)


def teacher_forced_logits(model: Any, tokens: Sequence[int], cache: str, page_size: int = 16) -> torch.Tensor:
    """(len(tokens), vocab) float32: every position's logits of one prefill over a fresh cache."""
    c = model.config
    pages = -(-len(tokens) // page_size)
    kv = KVCache(c.num_layers, pages, page_size, c.num_kv_heads, c.head_dim, kv_dtype(cache))
    return model.forward(prefill_batch(tokens, list(range(pages)), page_size), kv).float()


def mean_kl(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Mean over rows of KL(softmax(ref) || softmax(got)), in float64."""
    p_log = torch.log_softmax(ref.double(), -1)
    q_log = torch.log_softmax(got.double(), -1)
    return float((p_log.exp() * (p_log - q_log)).sum(-1).mean())


def kl_by_cache(engine: Any, prompts: Sequence[str], new_tokens: int, caches: Sequence[str],
                bar: Any = None) -> dict[str, Any]:
    """Each prompt continued new_tokens greedily (float32 cache: `engine`'s), then the mean KL of
    each cache's teacher-forced logits over the continuation positions, per prompt and overall.
    bar: a progress bar (if any), advanced once for the generation and once per prompt."""
    tick = bar.update if bar is not None else lambda n=1: None
    assert engine.kv_cache_dtype == torch.float32
    outs = engine.generate(list(prompts), pd.SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    tick(1)
    per: dict[str, list[float]] = {c: [] for c in caches}
    for out in outs:
        tokens = list(out.prompt_token_ids) + list(out.token_ids)
        first = len(out.prompt_token_ids) - 1          # the row whose logits chose the first new token
        rows = slice(first, len(tokens) - 1)
        ref = teacher_forced_logits(engine.model, tokens, "float32")[rows]
        for cache in caches:
            per[cache].append(mean_kl(ref, teacher_forced_logits(engine.model, tokens, cache)[rows]))
        tick(1)
    return {c: {"mean_kl": statistics.fmean(v), "max_prompt_kl": max(v), "per_prompt": v} for c, v in per.items()}


def capacity(model: Any, tokenizer: Any, budget: int) -> dict[str, Any]:
    """Tokens the same byte budget holds, per cache type, and each as a multiple of float16's."""
    out: dict[str, Any] = {}
    for cache in CACHES:
        engine = pd.Engine(model, tokenizer, pd.EngineConfig(kv_cache_dtype=cache, memory_budget_bytes=budget))
        out[cache] = {"bytes_per_token": engine.bytes_per_token,
                      "tokens": engine.pool.num_pages * engine.config.page_size}
    for cache in CACHES:
        out[cache]["vs_float16"] = out[cache]["tokens"] / out["float16"]["tokens"]
    return out


def decode_step_batch(batch: int, context: int, page_size: int) -> ForwardBatch:
    """One decode row per sequence, each the last of `context` tokens, sequence b on its own pages."""
    per = -(-context // page_size)
    table = torch.arange(batch * per, dtype=torch.int32).view(batch, per)
    pos = torch.full((batch,), context - 1, dtype=torch.long)
    slots = table[:, (context - 1) // page_size].long() * page_size + (context - 1) % page_size
    return ForwardBatch(torch.randint(0, 1000, (batch,)), pos, slots, table,
                        torch.full((batch,), context, dtype=torch.int32),
                        torch.arange(batch + 1, dtype=torch.int32), torch.arange(batch), num_decode=batch, max_new=1)


def decode_speed(model: Any, cache: str, batch: int, context: int, steps: int, page_size: int = 16) -> dict[str, Any]:
    c = model.config
    b = decode_step_batch(batch, context, page_size)
    kv = KVCache(c.num_layers, b.page_table.numel(), page_size, c.num_kv_heads, c.head_dim, kv_dtype(cache))
    g = torch.Generator().manual_seed(0)
    for t in (kv.k, kv.v):
        t.copy_((torch.randn(t.shape, generator=g) * (30 if kv.quantized else 1)).clamp(-100, 100).to(t.dtype))
    for s in (kv.k_scale, kv.v_scale):
        if s is not None:
            s.copy_(torch.rand(s.shape, generator=g) / 30)
    model.forward(b, kv)                                                 # warm-up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        model.forward(b, kv)
        times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    return {"step_ms": step * 1e3, "tokens_per_s": batch / step, "compiled": model._compiled is not None
            and model._compiled.runs(kv)}


def main() -> None:
    from common import plot, result_path, write_json
    from engine_vs_hf import progress
    from real_model import smollm2_chat, smollm2_f32_gguf, smollm2_gguf

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=256, help="continuation tokens per prompt (accuracy)")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--context", type=int, default=4096, help="context of each decode row (speed)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="decode rows (speed)")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=5, help="speed: every cache once a round, interleaved")
    ap.add_argument("--budget-mb", type=int, default=128, help="the byte budget of the capacity count")
    ap.add_argument("--quick", action="store_true", help="2 prompts x 32 tokens, 1k context, 5 steps")
    ap.add_argument("--out")
    args = ap.parse_args()
    load_before = os.getloadavg()
    if args.quick:
        args.tokens, args.prompts, args.context, args.steps, args.rounds = 32, 2, 1024, 5, 1
    caches = [c for c in CACHES if c != "float32"]
    chat = smollm2_chat(smollm2_gguf())
    prompts = [chat(p) for p in PROMPTS[:args.prompts]]
    speeds = ("float16", "int8", "fp8_e4m3", "float32")
    # one unit: the generation, a prompt's teacher-forced passes, the capacity count, a speed case
    bar = progress(1 + args.prompts + 1 + args.rounds * len(speeds) * len(args.batch), "kv_quant.py", unit="step")
    f32 = pd.Engine.from_pretrained(smollm2_f32_gguf(), enable_prefix_caching=False)
    accuracy = kl_by_cache(f32, prompts, args.tokens, caches, bar)
    cap = capacity(f32.model, f32.tokenizer, args.budget_mb << 20)
    bar.update(1)
    f32.close()
    q4 = pd.Engine.from_pretrained(smollm2_gguf())
    # the caches interleaved, round after round: a neighbour's burst lands on every cache alike; each
    # figure is the median of its rounds (each round's own median step beside it), each ratio to
    # float16 the median of the rounds' ratios
    rounds: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for _ in range(args.rounds):
        for cache in speeds:
            for b in args.batch:
                rounds.setdefault((cache, b), []).append(decode_speed(q4.model, cache, b, args.context, args.steps))
                bar.update(1)
    bar.close()
    speed: dict[str, dict[str, Any]] = {}
    for (cache, b), runs in rounds.items():
        step = statistics.median(r["step_ms"] for r in runs)
        speed.setdefault(cache, {})[str(b)] = {"step_ms": step, "tokens_per_s": b / step * 1e3,
                                               "rounds_step_ms": [r["step_ms"] for r in runs],
                                               "compiled": all(r["compiled"] for r in runs)}
    for (cache, b), runs in rounds.items():       # paired by round: the machine's drift cancels
        speed[cache][str(b)]["vs_float16"] = statistics.median(
            f16["step_ms"] / r["step_ms"] for r, f16 in zip(runs, rounds[("float16", b)]))
    result = {"model": "SmolLM2-135M-Instruct", "threads": torch.get_num_threads(),
              "load_before": load_before, "kl_bound": KL_BOUND,
              "accuracy": {"prompts": args.prompts, "tokens": args.tokens, "model_weights": "float32", **accuracy},
              "capacity": {"budget_bytes": args.budget_mb << 20, **cap},
              "decode_speed": {"context": args.context, "model_weights": "q4_1", "rounds": args.rounds, **speed}}
    result["load_after"] = os.getloadavg()
    path = result_path("kv_quant", args.out)
    write_json(path, result)

    def draw(axes: Any) -> None:
        a, b, s = axes
        a.bar(caches, [accuracy[c]["mean_kl"] for c in caches])
        a.axhline(KL_BOUND, color="r", ls="--")
        a.set_yscale("log")
        a.set_title(f"mean KL vs float32 cache ({args.prompts} x {args.tokens} tokens)")
        b.bar(list(CACHES), [cap[c]["vs_float16"] for c in CACHES])
        b.set_title("tokens per byte vs float16")
        for i, batch in enumerate(args.batch):
            s.bar([x + 0.4 * i for x in range(4)], [speed[c][str(batch)]["tokens_per_s"] for c in speed], 0.4,
                  label=f"batch {batch}")
        s.set_xticks([x + 0.2 for x in range(4)], list(speed))
        s.set_title(f"decode tokens/s at {args.context} context (q4_1 weights)")
        s.legend()
    plot(path, draw, size=(15, 4), ncols=3)
    print(f"{'cache':10} {'mean KL':>10} {'bytes/token':>12} {'x fp16 tokens':>14} "
          + " ".join(f"{'tok/s b' + str(b):>12} {'x fp16':>7}" for b in args.batch))
    for c in CACHES:
        kl = accuracy[c]["mean_kl"] if c in accuracy else 0.0
        print(f"{c:10} {kl:10.2e} {cap[c]['bytes_per_token']:12d} {cap[c]['vs_float16']:14.3f} "
              + " ".join(f"{speed[c][str(b)]['tokens_per_s']:12.1f} {speed[c][str(b)]['vs_float16']:7.2f}"
                         for b in args.batch))
    print(path)


if __name__ == "__main__":
    main()
