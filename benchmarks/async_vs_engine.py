"""The same workload through Engine.generate and through AsyncEngine, side by side, as a ratio.

    .venv/bin/python benchmarks/async_vs_engine.py [--model DIR] [--tokens 500] [--streams 1]
        [--rounds 5] [--out FILE]

Each round runs both, alternating which goes first; the medians give the ratio (AsyncEngine
tokens/s over Engine tokens/s; the goal is >= 0.9). JSON goes to benchmarks/results/.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time
from datetime import date

import torch

import pagedecode as pd
from common import result_path, write_json



def default_model() -> str:
    env = os.environ.get("PAGEDECODE_STORIES")
    if env:
        return env
    from pagedecode.model.default_model import default_model_path
    return str(default_model_path())


def run_sync(eng: pd.Engine, prompts: list[str], params: pd.SamplingParams) -> float:
    t = time.perf_counter()
    outs = eng.generate(prompts, params)
    return sum(o.usage.returned_tokens for o in outs) / (time.perf_counter() - t)


async def run_async(eng: pd.Engine, prompts: list[str], params: pd.SamplingParams, interval: float,
                    leave_core: bool | None = None) -> float:
    options = {} if leave_core is None else {"leave_core_for_loop": leave_core}
    async with pd.AsyncEngine(eng, stream_interval_s=interval, **options) as ae:
        async def one(prompt: str) -> int:
            n = 0
            async for ev in ae.submit(prompt, params):
                if isinstance(ev, pd.DeltaEvent):
                    n += len(ev.token_ids)
            return n
        t = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        return sum(counts) / (time.perf_counter() - t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: $PAGEDECODE_STORIES or the built-in model)")
    ap.add_argument("--tokens", type=int, default=500, help="tokens per request (default 500)")
    ap.add_argument("--streams", type=int, default=1, help="concurrent requests (default 1)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    ap.add_argument("--stream-interval", type=float, default=0.001,
                    help="AsyncEngine stream_interval_s (default 0.001, its default; 0 wakes every step)")
    ap.add_argument("--leave-core", choices=["default", "on", "off"], default="default",
                    help="AsyncEngine leave_core_for_loop (default: AsyncEngine's own choice)")
    ap.add_argument("--prompt", default="Once upon a time")
    ap.add_argument("--out", default=None, help="JSON path (default: a new file under benchmarks/results/)")
    args = ap.parse_args(argv)
    leave = {"default": None, "on": True, "off": False}[args.leave_core]
    model = args.model or default_model()
    eng = pd.Engine.from_pretrained(model, max_batch_size=max(8, args.streams))
    params = pd.SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    prompts = [args.prompt] * args.streams
    run_sync(eng, prompts, pd.SamplingParams(max_tokens=16))          # warm-up
    sync, asyn = [], []
    for r in range(args.rounds):
        if r % 2 == 0:
            sync.append(run_sync(eng, prompts, params))
            asyn.append(asyncio.run(run_async(eng, prompts, params, args.stream_interval, leave)))
        else:
            asyn.append(asyncio.run(run_async(eng, prompts, params, args.stream_interval, leave)))
            sync.append(run_sync(eng, prompts, params))
        print(f"round {r + 1}/{args.rounds}: engine {sync[-1]:.0f} tok/s, async {asyn[-1]:.0f} tok/s", file=sys.stderr)
    result = {
        "date": date.today().isoformat(), "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "model": model,
        "tokens": args.tokens, "streams": args.streams, "rounds": args.rounds,
        "stream_interval_s": args.stream_interval, "leave_core_for_loop": args.leave_core,
        "engine_tok_s": sync, "async_tok_s": asyn,
        "engine_median": statistics.median(sync), "async_median": statistics.median(asyn),
        "ratio": statistics.median(asyn) / statistics.median(sync),
    }
    print(f"AsyncEngine / Engine: {result['ratio']:.2f} (medians {result['async_median']:.0f} / "
          f"{result['engine_median']:.0f} tok/s)")
    out = result_path("async_vs_engine", args.out)
    write_json(out, result)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
