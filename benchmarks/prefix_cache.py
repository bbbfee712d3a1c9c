"""A shared-system-prompt workload with the prefix cache on and off, in one run.

    .venv/bin/python benchmarks/prefix_cache.py [--model DIR] [--requests 64] [--prefix 512]
        [--suffix 32] [--max-tokens 16] [--out FILE]

Reports time to first token (mean, p50, p90) and total tokens/s for both, and the ratios.
JSON under benchmarks/results/ and a PNG beside it. The model: --model, else $PAGEDECODE_STORIES,
else the built-in default model; the prefix is capped to fit the model's context.
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from datetime import date

import pagedecode as pd
from common import plot, result_path, write_json



def run(model: str, prompts: list[list[int]], max_tokens: int, cache: bool) -> dict:
    eng = pd.Engine.from_pretrained(model, enable_prefix_caching=cache, max_batch_size=16,
                                    max_tokens_per_step=512)
    eng.generate([prompts[0][:8]], pd.SamplingParams(max_tokens=2))          # warm-up (not cached)
    eng.pool.clear_cache()
    params = pd.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    rids = [eng.add_request(p, params) for p in prompts]
    first: dict[str, float] = {}
    while eng.has_unfinished():
        for ev in eng.step():
            if isinstance(ev, pd.DeltaEvent) and ev.request_id not in first:
                first[ev.request_id] = time.perf_counter() - t0
    wall = time.perf_counter() - t0
    outs = [eng.result(r) for r in rids]
    ttft = sorted(first.values())
    return {"cache": cache, "wall_s": wall,
            "tokens_per_s": sum(o.usage.prompt_tokens + o.usage.returned_tokens for o in outs) / wall,
            "output_tokens_per_s": sum(o.usage.returned_tokens for o in outs) / wall,
            "ttft_mean_ms": 1000 * statistics.mean(ttft), "ttft_p50_ms": 1000 * ttft[len(ttft) // 2],
            "ttft_p90_ms": 1000 * ttft[int(0.9 * len(ttft))], "ttft_ms": [1000 * x for x in ttft],
            "cached_tokens": sum(o.usage.cached_tokens for o in outs),
            "processed_tokens": sum(o.usage.processed_tokens for o in outs),
            "outputs": [o.selected_token_ids for o in outs]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.environ.get("PAGEDECODE_STORIES"), help="model directory")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=512, help="shared system-prompt tokens")
    ap.add_argument("--suffix", type=int, default=32, help="unique tokens per request")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.model is None:
        from pagedecode.model.default_model import default_model_path
        args.model = str(default_model_path())
    eng = pd.Engine.from_pretrained(args.model)
    vocab = eng.vocab_size
    ctx = eng.max_context
    prefix_len = min(args.prefix, ctx - args.suffix - args.max_tokens - 1)
    rng = random.Random(0)
    system = [rng.randrange(3, vocab) for _ in range(prefix_len)]
    prompts = [system + [rng.randrange(3, vocab) for _ in range(args.suffix)] for _ in range(args.requests)]
    print(f"{args.requests} requests, shared prefix {prefix_len} tokens, suffix {args.suffix}", file=sys.stderr)
    off = run(args.model, prompts, args.max_tokens, cache=False)
    print(f"cache off: {off['tokens_per_s']:.0f} tok/s, TTFT mean {off['ttft_mean_ms']:.0f} ms", file=sys.stderr)
    on = run(args.model, prompts, args.max_tokens, cache=True)
    print(f"cache on:  {on['tokens_per_s']:.0f} tok/s, TTFT mean {on['ttft_mean_ms']:.0f} ms", file=sys.stderr)
    same = on.pop("outputs") == off.pop("outputs")
    result = {"date": date.today().isoformat(), "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "model": args.model, "requests": args.requests, "prefix_tokens": prefix_len,
              "suffix_tokens": args.suffix, "max_tokens": args.max_tokens, "off": off, "on": on,
              "same_outputs": same, "throughput_ratio": on["tokens_per_s"] / off["tokens_per_s"],
              "ttft_mean_ratio": off["ttft_mean_ms"] / on["ttft_mean_ms"]}
    print(f"throughput on/off {result['throughput_ratio']:.2f}x, TTFT off/on {result['ttft_mean_ratio']:.2f}x, "
          f"same outputs: {same}")
    out = result_path("prefix_cache", args.out)
    write_json(out, result)

    def draw(axes):
        a, b = axes
        for r, name in ((off, "cache off"), (on, "cache on")):
            xs = r["ttft_ms"]
            a.plot(xs, [i / len(xs) for i in range(len(xs))], label=name)
        a.set_xlabel("time to first token (ms)")
        a.set_ylabel("fraction of requests")
        a.legend()
        b.bar(["cache off", "cache on"], [off["tokens_per_s"], on["tokens_per_s"]])
        b.set_ylabel("tokens/s (prompt + output)")
        a.figure.suptitle(f"prefix cache: {args.requests} requests sharing {prefix_len} tokens")
    plot(out, draw, ncols=2)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
