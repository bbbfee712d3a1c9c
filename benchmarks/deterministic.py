"""Deterministic mode's cost: tokens/s with EngineConfig.deterministic on vs off, both modes
interleaved in one run (off, on, off, on, ...: the shared machine's load falls on both alike),
and the least CPU time of one engine step per mode (--steps: decode steps of several rows,
prefill chunks; on --step-threads threads), steadier than tokens/s on a loaded machine.

Workloads and models as benchmarks/engine_vs_hf.py (single: one 64-token prompt, 128 new tokens;
mixed: 64 requests of 16-512 prompt and 16-256 output tokens; --mixed-requests / --max-new
shrink them for a loaded machine), stories260k and the random SmolLM-135M-shaped llama135m,
float32 and bfloat16, on CPU. Reported per row: useful tokens/s (wall clock) and tokens per
CPU-second of this process (less sensitive to other processes on the machine), the median of
--repeat runs per mode and the best, the ratios deterministic / default, the load average
before and after, and whether both modes chose the same greedy tokens. JSON + PNG to
benchmarks/results/deterministic-<date>-<time>.json unless --out.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import pagedecode as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import plot, result_path, write_json  # noqa: E402
from engine_vs_hf import DTYPES, model_dirs, workload  # noqa: E402


def run_once(engine: Any, reqs: list[tuple[list[int], int]]) -> dict[str, Any]:
    t0, c0 = time.perf_counter(), time.process_time()
    rids = [engine.add_request(p, pd.SamplingParams(max_tokens=o, ignore_eos=True)) for p, o in reqs]
    while engine.has_unfinished():
        engine.step()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    useful = sum(o for _, o in reqs)
    return {"tokens_per_s": useful / wall, "tokens_per_cpu_s": useful / cpu, "seconds": wall,
            "tokens": [engine.result(r).selected_token_ids for r in rids]}


def step_seconds(engine: Any, kind: str, rows: int, rng: random.Random) -> float:
    """CPU seconds of one engine step: a decode step of `rows` sequences (8-token prompts, fresh
    each time), or the prefill of one fresh `rows`-token prompt (random ids: no cached prefix)."""
    params = pd.SamplingParams(max_tokens=4, ignore_eos=True)
    if kind == "decode":
        for _ in range(rows):
            engine.add_request([1] + [rng.randrange(3, 500) for _ in range(7)], params)
        engine.step()                                    # the prefills
        engine.step()
    else:
        engine.add_request([1] + [rng.randrange(3, 500) for _ in range(rows - 1)], params)
    c0 = time.process_time()
    engine.step()
    spent = time.process_time() - c0
    while engine.has_unfinished():
        engine.step()
    return spent


def step_rows(engines: dict[bool, Any], name: str, dtype: str, steps: str, rounds: int,
              threads: int) -> list[dict[str, Any]]:
    """The least CPU time of one step per mode over `rounds` interleaved rounds, on `threads`
    threads: steadier than tokens/s on a shared machine (another process's load only adds)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    rng = random.Random(0)
    out = []
    try:
        for spec in steps.split(","):
            kind, rows = spec.split(":")[0], int(spec.split(":")[1])
            seconds: dict[bool, list[float]] = {False: [], True: []}
            for i in range(rounds):
                for det in ((False, True) if i % 2 == 0 else (True, False)):
                    seconds[det].append(step_seconds(engines[det], kind, rows, rng))
            row = {"model": name, "dtype": dtype, "step": f"{kind} {rows}", "threads": threads,
                   "default_ms": 1e3 * min(seconds[False]), "deterministic_ms": 1e3 * min(seconds[True]),
                   "load_avg_1m": os.getloadavg()[0]}
            row["ratio"] = row["deterministic_ms"] / row["default_ms"]
            out.append(row)
            print(f"== {name} {dtype} {kind} {rows} rows, {threads} thread(s): least CPU time a step "
                  f"{row['default_ms']:.2f} ms default, {row['deterministic_ms']:.2f} ms deterministic "
                  f"({row['ratio']:.3f})", flush=True)
    finally:
        torch.set_num_threads(before)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="stories260k,llama135m")
    ap.add_argument("--model", default=None, help="one Hugging Face checkpoint folder instead of --models")
    ap.add_argument("--stories", default=None)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--workloads", default="single,mixed")
    ap.add_argument("--mixed-requests", type=int, default=64, help="the mixed workload's first N requests")
    ap.add_argument("--max-new", type=int, default=None, help="cap every request's new tokens")
    ap.add_argument("--repeat", type=int, default=3, help="runs per mode (interleaved)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--steps", default="decode:1,decode:4,decode:8,decode:32,prefill:64,prefill:256",
                    help="per-step CPU times to take (kind:rows, kind decode or prefill; '' for none)")
    ap.add_argument("--step-rounds", type=int, default=5)
    ap.add_argument("--step-threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {"benchmark": "deterministic", "threads": torch.get_num_threads(),
                              "load_before": os.getloadavg(), "rows": rows, "steps": []}
    for name, path in model_dirs(args):
        for dtype in args.dtypes.split(","):
            engines = {det: pd.Engine.from_pretrained(path, dtype=DTYPES[dtype], deterministic=det, max_batch_size=64,
                                                      max_tokens_per_step=2048) for det in (False, True)}
            mc = engines[False].model.config
            if args.steps:
                result["steps"] += step_rows(engines, name, dtype, args.steps, args.step_rounds, args.step_threads)
            for wl in args.workloads.split(","):
                reqs = workload(wl, mc.vocab_size, engines[False].max_context)[:args.mixed_requests]
                if args.max_new:
                    reqs = [(p, min(o, args.max_new)) for p, o in reqs]
                for eng in engines.values():                 # warm-up
                    eng.generate([reqs[0][0][:8]], pd.SamplingParams(max_tokens=2, ignore_eos=True))
                runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
                load0 = os.getloadavg()[0]
                for i in range(args.repeat):
                    for det in ((False, True) if i % 2 == 0 else (True, False)):
                        r = run_once(engines[det], reqs)
                        runs[det].append(r)
                        print(f"{name} {dtype} {wl} {'deterministic' if det else 'default'} run {i + 1}: "
                              f"{r['tokens_per_s']:.1f} tok/s, {r['tokens_per_cpu_s']:.1f} tok/cpu-s "
                              f"(load {os.getloadavg()[0]:.1f})", flush=True)
                med = {det: {k: statistics.median(r[k] for r in runs[det]) for k in ("tokens_per_s", "tokens_per_cpu_s")}
                       for det in runs}
                row = {"model": name, "dtype": dtype, "workload": wl, "requests": len(reqs),
                       "useful_tokens": sum(o for _, o in reqs),
                       "default": med[False], "deterministic": med[True],
                       "ratio_wall": med[True]["tokens_per_s"] / med[False]["tokens_per_s"],
                       "ratio_cpu": med[True]["tokens_per_cpu_s"] / med[False]["tokens_per_cpu_s"],
                       # the best run per mode: another process's load only slows a run down
                       "ratio_best_wall": (max(r["tokens_per_s"] for r in runs[True])
                                           / max(r["tokens_per_s"] for r in runs[False])),
                       "ratio_best_cpu": (max(r["tokens_per_cpu_s"] for r in runs[True])
                                          / max(r["tokens_per_cpu_s"] for r in runs[False])),
                       "runs": {str(det): [{k: v for k, v in r.items() if k != "tokens"} for r in runs[det]]
                                for det in runs},
                       "same_tokens": runs[False][0]["tokens"] == runs[True][0]["tokens"],
                       "deterministic_repeatable": all(r["tokens"] == runs[True][0]["tokens"] for r in runs[True]),
                       "load_avg_1m": [load0, os.getloadavg()[0]]}
                rows.append(row)
                print(f"== {name} {dtype} {wl}: deterministic / default = {row['ratio_wall']:.3f} (wall), "
                      f"{row['ratio_cpu']:.3f} (CPU time); best runs {row['ratio_best_wall']:.3f}, "
                      f"{row['ratio_best_cpu']:.3f}", flush=True)
            for eng in engines.values():
                eng.close()
    result["load_after"] = os.getloadavg()
    out = result_path("deterministic", args.out)
    write_json(out, result)

    steps = result["steps"]

    def draw(axes: Any) -> None:
        ax = axes[0] if steps else axes
        labels = [f"{r['model']}\n{r['dtype']}\n{r['workload']}" for r in rows]
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["ratio_wall"] for r in rows], 0.4, label="wall clock")
        ax.bar([x + 0.2 for x in xs], [r["ratio_cpu"] for r in rows], 0.4, label="CPU time")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(0.9, color="r", lw=0.8, ls="--", label="10% slower")
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_ylabel("tokens/s, deterministic / default")
        ax.legend(fontsize=7)
        if steps:                     # CPU time a step: deterministic / default (above 1: slower)
            ax = axes[1]
            ax.bar(range(len(steps)), [r["ratio"] for r in steps])
            ax.axhline(1.0, color="k", lw=0.8)
            ax.axhline(1.1, color="r", lw=0.8, ls="--", label="10% slower")
            ax.set_xticks(list(range(len(steps))), [f"{r['model']}\n{r['dtype'][:4]}\n{r['step']}" for r in steps],
                          fontsize=6)
            ax.set_ylabel("least CPU time a step, deterministic / default")
            ax.legend(fontsize=7)
    plot(out, draw, size=(max(6, 1.3 * len(rows)) + (max(6, 0.6 * len(steps)) if steps else 0), 4),
         ncols=2 if steps else 1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
