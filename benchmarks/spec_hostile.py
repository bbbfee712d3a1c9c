"""Speculation under hostile sampling (issue 34, item 8): a repetitive prompt sampled at temperature
1.5, where n-gram drafts match the prompt but almost never survive verification. Goal: no
workload below 0.95x of speculation off. Off and on (k = 4 and 64) alternate in one run, --repeat
rounds, medians reported; outputs must be identical on and off (checked).

    .venv/bin/python benchmarks/spec_hostile.py [--models default,smollm2] [--repeat 5]

default: the built-in model (model/default_model.py); smollm2: SmolLM2-135M-Instruct in float32
(its Q4_1 file dequantized once, benchmarks/real_model.py). JSON + PNG under benchmarks/results/.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

import pagedecode as pd
from pagedecode.model.default_model import default_model_path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import plot, result_path, write_json  # noqa: E402
from real_model import smollm2_f32_gguf  # noqa: E402

REPETITIVE = "the cat sat on the mat. " * 20
HOT = pd.SamplingParams(max_tokens=256, temperature=1.5, seed=1, ignore_eos=True)


def timed(engine: pd.Engine) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    out = engine.generate([REPETITIVE], HOT)[0]
    return len(out.token_ids) / (time.perf_counter() - t0), out.token_ids


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="default,smollm2")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    out = result_path("spec-hostile", args.out)
    result: dict[str, Any] = {"date": str(date.today()), "cpus": os.cpu_count(), "rows": []}
    for name in args.models.split(","):
        path = default_model_path() if name == "default" else smollm2_f32_gguf()
        engines = {"off": pd.Engine.from_pretrained(path)}
        for k in (4, 64):
            engines[f"k={k}"] = pd.Engine.from_pretrained(path, speculative=pd.SpeculativeConfig(num_tokens=k))
        for e in engines.values():
            e.generate([REPETITIVE], pd.SamplingParams(max_tokens=4))               # first-call costs
        runs: dict[str, list[float]] = {m: [] for m in engines}
        loads: list[float] = []
        want = None
        for rep in range(args.repeat):
            order = list(engines) if rep % 2 == 0 else list(reversed(engines))
            for mode in order:
                loads.append(round(os.getloadavg()[0], 2))
                tps, ids = timed(engines[mode])
                want = want or ids
                assert ids == want, f"{name} {mode}: speculation changed the tokens"
                runs[mode].append(tps)
                print(f"{name:8s} {mode:5s} run {rep + 1}: {tps:8.1f} tok/s (load {loads[-1]})", file=sys.stderr,
                      flush=True)
        med = {m: statistics.median(v) for m, v in runs.items()}
        row = {"model": name, "off_tok_s": round(med["off"], 1), "loads": loads,
               "runs": {m: [round(x, 1) for x in v] for m, v in runs.items()}}
        for k in (4, 64):
            row[f"k{k}_tok_s"] = round(med[f"k={k}"], 1)
            row[f"k{k}_ratio"] = round(med[f"k={k}"] / med["off"], 3)
        result["rows"].append(row)
        write_json(out, result)
    plot(out, lambda axes: draw(axes, result))
    for r in result["rows"]:
        print(f"{r['model']:8s} off {r['off_tok_s']:8.1f} tok/s  k=4 {r['k4_ratio']:.3f}x  k=64 {r['k64_ratio']:.3f}x  "
              f"(load {min(r['loads'])}-{max(r['loads'])})")
    print(f"written {out}")
    return 0


def draw(axes: Any, result: dict[str, Any]) -> None:
    rows = result["rows"]
    x = range(len(rows))
    axes.bar([i - 0.2 for i in x], [r["k4_ratio"] for r in rows], 0.4, label="k = 4")
    axes.bar([i + 0.2 for i in x], [r["k64_ratio"] for r in rows], 0.4, label="k = 64")
    axes.axhline(0.95, color="red", lw=0.8, ls="--")
    axes.axhline(1.0, color="gray", lw=0.8)
    axes.set_xticks(list(x), [r["model"] for r in rows])
    axes.set_ylabel("tokens/s on / off")
    axes.set_title(f"temperature 1.5 over a repetitive prompt, {result['date']}")
    axes.legend()


if __name__ == "__main__":
    sys.exit(main())
