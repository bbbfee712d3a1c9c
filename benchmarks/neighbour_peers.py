"""Beside a busy neighbour, against llama.cpp (issue 36, item 3): each engine's tokens/s idle and
with one `python -c 'while 1: pass'` process running, interleaved in one run, and the share of its
idle speed each keeps. Goal: pagedecode keeps at least the share llama.cpp keeps, single and mixed,
stories260k and SmolLM2-135M-Instruct.

    python benchmarks/neighbour_peers.py [--models stories260k,smollm2] [--workloads single,mixed]

Workloads are engine_vs_hf.py's (single: a 64-token prompt + 128 tokens; mixed: 64 requests of
varied lengths, llama.cpp through llama-batched-bench at the mean lengths), --threads each. Files:
stories260k as llama.cpp's own f32 GGUF of the checkpoint, SmolLM2 as its Q4_1 file; both engines
load the same file. pagedecode runs in a child process per run (a fresh heap and thread pool, as a
user starts it: `import pagedecode` before torch, as its commands do). JSON + PNG under
benchmarks/results/; each run with the load average as it began.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from datetime import date
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_vs_hf as evh  # noqa: E402
from common import plot, result_path, write_json  # noqa: E402
from real_model import smollm2_gguf  # noqa: E402

# pagedecode imported before torch, as its commands do: it sets torch's OpenMP spin (env.py) then
CHILD = """
import json, sys
import pagedecode
import torch
sys.path.insert(0, {bench!r})
import engine_vs_hf as evh
torch.set_num_threads({threads})
reqs = evh.workload({workload!r}, {vocab}, {context})
r = evh.run_pagedecode(__import__("pathlib").Path({path!r}), reqs, "cpu", "float32", kv_cache_dtype="float16")
print(json.dumps({{"seconds": r["seconds"]}}))
"""
MODELS = {"stories260k": (512, 512), "smollm2": (49152, 8192)}      # vocab, context


def model_file(name: str, stories: Path) -> Path:
    if name == "smollm2":
        return smollm2_gguf()
    f = evh.llamacpp_gguf(stories, "float32")
    assert f is not None, "llama.cpp is not built: benchmarks/peers/llamacpp.sh"
    return f


def run(engine: str, path: Path, workload: str, model: str, threads: int) -> float:
    """Useful tokens/s of one run."""
    vocab, context = MODELS[model]
    reqs = evh.workload(workload, vocab, context)
    useful = sum(o for _, o in reqs)
    if engine == "llamacpp":
        return useful / evh.run_llamacpp(path, reqs, threads, 1)["seconds"]
    code = CHILD.format(bench=str(Path(__file__).resolve().parent), threads=threads, workload=workload,
                        vocab=vocab, context=context, path=str(path))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    if p.returncode:
        raise SystemExit(p.stderr[-3000:])
    return useful / json.loads(p.stdout.strip().splitlines()[-1])["seconds"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="stories260k,smollm2")
    ap.add_argument("--workloads", default="single,mixed")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--stories", default=None, help="the stories260k folder")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    stories = evh.stories_dir(args.stories)
    out = result_path("neighbour-peers", args.out)
    result: dict[str, Any] = {"date": str(date.today()), "threads": args.threads, "cpus": os.cpu_count(), "rows": []}
    for model in args.models.split(","):
        path = model_file(model, stories)
        for workload in args.workloads.split(","):
            runs: dict[tuple[str, str], list[float]] = {}
            loads: dict[tuple[str, str], list[float]] = {}
            for rep in range(args.repeats):
                for condition in ("idle", "neighbour"):
                    busy = subprocess.Popen([sys.executable, "-c", "while 1: pass"]) if condition == "neighbour" else None
                    try:
                        for engine in (("pagedecode", "llamacpp") if rep % 2 == 0 else ("llamacpp", "pagedecode")):
                            load = os.getloadavg()[0]
                            tps = run(engine, path, workload, model, args.threads)
                            runs.setdefault((engine, condition), []).append(tps)
                            loads.setdefault((engine, condition), []).append(round(load, 2))
                            print(f"{model:11s} {workload:6s} {condition:9s} {engine:10s} {tps:8.1f} tok/s "
                                  f"(load {load:.1f})", file=sys.stderr, flush=True)
                    finally:
                        if busy is not None:
                            busy.kill()
                            busy.wait()
            row: dict[str, Any] = {"model": model, "workload": workload, "file": path.name}
            for engine in ("pagedecode", "llamacpp"):
                idle = statistics.median(runs[(engine, "idle")])
                near = statistics.median(runs[(engine, "neighbour")])
                row[engine] = {"idle_tok_s": round(idle, 1), "neighbour_tok_s": round(near, 1),
                               "kept": round(near / idle, 3), "loads": {c: loads[(engine, c)] for c in ("idle", "neighbour")}}
            row["kept_vs_llamacpp"] = round(row["pagedecode"]["kept"] / row["llamacpp"]["kept"], 2)
            row["idle_vs_llamacpp"] = round(row["pagedecode"]["idle_tok_s"] / row["llamacpp"]["idle_tok_s"], 2)
            row["goal_met"] = row["pagedecode"]["kept"] >= row["llamacpp"]["kept"]
            result["rows"].append(row)
            write_json(out, result)
    plot(out, lambda axes: draw(axes, result))
    print(f"{'model':11s} {'work':6s} {'pd idle':>8s} {'pd busy':>8s} {'kept':>5s} {'lc idle':>8s} {'lc busy':>8s} {'kept':>5s}")
    for r in result["rows"]:
        p, l = r["pagedecode"], r["llamacpp"]
        print(f"{r['model']:11s} {r['workload']:6s} {p['idle_tok_s']:8.1f} {p['neighbour_tok_s']:8.1f} {p['kept']:5.2f} "
              f"{l['idle_tok_s']:8.1f} {l['neighbour_tok_s']:8.1f} {l['kept']:5.2f}")
    print(f"written {out}")
    return 0


def draw(axes: Any, result: dict[str, Any]) -> None:
    rows = result["rows"]
    x = range(len(rows))
    axes.bar([i - 0.2 for i in x], [r["pagedecode"]["kept"] for r in rows], 0.4, label="pagedecode")
    axes.bar([i + 0.2 for i in x], [r["llamacpp"]["kept"] for r in rows], 0.4, label="llama.cpp")
    axes.set_xticks(list(x), [f"{r['model']} {r['workload']}" for r in rows])
    axes.set_ylabel("tokens/s with a busy neighbour / idle")
    axes.set_title(f"one busy neighbour, {result['threads']} threads each, {result['date']}")
    axes.legend()


if __name__ == "__main__":
    sys.exit(main())
