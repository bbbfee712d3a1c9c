"""pagedecode in two dtypes on one checkpoint, runs interleaved: the speed ratio between them.

engine_vs_hf.py runs one dtype per invocation, minutes apart; on a shared machine whose memory
bandwidth drifts (this project's CPU VM: up to 1.5x between runs) the ratio of two such runs
measures the drift as much as the dtype. Here both engines are loaded once and the workload runs
in rounds, A then B then A ..., so each round's ratio compares runs seconds apart; the JSON keeps
every run, each round's ratio, and their median.

    python benchmarks/dtype_ratio.py                         # random 135M, single, f32 vs bf16
    python benchmarks/dtype_ratio.py --workload mixed --rounds 3 --model DIR

Workloads and models are engine_vs_hf.py's (--models / --model / --stories, --workload).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import date
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import plot, result_path, write_json  # noqa: E402
from engine_vs_hf import DTYPES, model_dirs, progress, workload  # noqa: E402

import pagedecode as pd  # noqa: E402


def run_once(engine: Any, reqs: list[tuple[list[int], int]]) -> float:
    """Seconds for the whole workload, greedy, EOS ignored."""
    t0 = time.perf_counter()
    for p, o in reqs:
        engine.add_request(p, pd.SamplingParams(max_tokens=o, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama135m")
    ap.add_argument("--model", help="one Hugging Face checkpoint folder instead of --models")
    ap.add_argument("--stories", help="the stories260k folder (else $PAGEDECODE_STORIES / $PAGEDECODE_SHARED)")
    ap.add_argument("--workload", default="single", choices=["single", "mixed"])
    ap.add_argument("--dtypes", default="float32,bfloat16", help="two dtypes: A,B (the ratio is B's speed / A's)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", help="the JSON path (default: a new file under benchmarks/results/)")
    args = ap.parse_args(argv)
    dtypes = args.dtypes.split(",")
    if len(dtypes) != 2 or any(d not in DTYPES for d in dtypes):
        raise SystemExit(f"--dtypes: two of {sorted(DTYPES)}, comma-separated")
    if args.rounds < 1:
        raise SystemExit("--rounds: at least 1")
    torch.set_num_threads(args.threads)
    out = result_path(f"dtype_ratio-{dtypes[0]}-{dtypes[1]}", args.out)
    rows: list[dict[str, Any]] = []
    result = {"date": str(date.today()), "threads": args.threads, "workload": args.workload, "dtypes": dtypes,
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "torch": torch.__version__, "rounds": args.rounds, "results": rows}
    for mname, path in model_dirs(args):
        cfg = json.loads((path / "config.json").read_text())
        reqs = workload(args.workload, cfg["vocab_size"], cfg.get("max_position_embeddings", 2048))
        useful = sum(o for _, o in reqs)
        total = sum(len(p) + o for p, o in reqs)
        engines = {d: pd.Engine.from_pretrained(path, device="cpu", dtype=DTYPES[d], max_batch_size=64,
                                                max_cache_tokens=total + 64 * 16, max_tokens_per_step=2048,
                                                enable_prefix_caching=False) for d in dtypes}
        for e in engines.values():                                            # warm-up
            e.generate([reqs[0][0][:8]], pd.SamplingParams(max_tokens=4, ignore_eos=True))
        runs: dict[str, list[float]] = {d: [] for d in dtypes}
        bar = progress(2 * args.rounds, f"{mname} {args.workload}", unit="run")
        for r in range(args.rounds):
            order = dtypes if r % 2 == 0 else dtypes[::-1]      # neither dtype always runs first
            for d in order:
                seconds = run_once(engines[d], reqs)
                runs[d].append(seconds)
                bar.update()
        bar.close()
        for e in engines.values():
            e.close()
        a, b = dtypes
        ratios = [ta / tb for ta, tb in zip(runs[a], runs[b])]
        row = {"model": mname, "useful_tokens": useful,
               **{d: {"tok_s": [round(useful / s, 1) for s in runs[d]],
                      "median_tok_s": round(useful / statistics.median(runs[d]), 1)} for d in dtypes},
               "round_ratios": [round(x, 3) for x in ratios], "median_ratio": round(statistics.median(ratios), 3),
               "min_ratio": round(min(ratios), 3), "max_ratio": round(max(ratios), 3)}
        rows.append(row)
        print(f"{mname:<12} {args.workload:<7} {a} {row[a]['median_tok_s']:>8.1f} tok/s  {b} "
              f"{row[b]['median_tok_s']:>8.1f} tok/s  {b}/{a}: median {row['median_ratio']:.3f} "
              f"(rounds {row['min_ratio']:.3f}-{row['max_ratio']:.3f})", flush=True)
        write_json(out, result)

    def draw(ax: Any) -> None:
        for row in rows:
            ax.plot(range(1, len(row["round_ratios"]) + 1), row["round_ratios"], "o-", label=row["model"])
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_xlabel("round")
        ax.set_ylabel(f"{dtypes[1]} tok/s / {dtypes[0]} tok/s")
        ax.set_title(f"pagedecode {args.workload}, runs interleaved, {args.threads} threads, {result['date']}")
        ax.legend()

    plot(out, draw, size=(7, 4))
    print(f"wrote {out} (+ .png)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
