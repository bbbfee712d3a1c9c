"""Single-stream decode beside a busy neighbour (issue 36, item 3): stories260k tokens/s at N
threads, idle and with one `python -c 'while 1: pass'` process running, for one or more source
trees side by side in one run (before / after a change: each tree's pagedecode and its compiled
extension, imported through PYTHONPATH in its own process). Runs alternate tree by tree within each
repeat, so the machine's other load falls on all alike; `uptime`'s load is printed beside each.

    python benchmarks/neighbour.py --trees /work/main . --threads 2 --repeats 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import busy_neighbours, run_in_tree  # noqa: E402

MEASURE = """
import json, sys, time, torch
import pagedecode as pd
torch.set_num_threads({threads})
eng = pd.Engine.from_pretrained({model!r})
params = pd.SamplingParams(max_tokens={tokens}, ignore_eos=True)
eng.generate("Once upon a time", pd.SamplingParams(max_tokens=16, ignore_eos=True))      # warm
t = time.perf_counter()
out = eng.generate("Once upon a time", params)[0]
dt = time.perf_counter() - t
print(json.dumps({{"tokens_per_s": len(out.token_ids) / dt, "cpu_ext": eng.model.uses_cpu_extension()}}))
"""


def load() -> str:
    return f"{os.getloadavg()[0]:.2f}"


def run(tree: Path, model: str, threads: int, tokens: int) -> dict:
    return run_in_tree(tree, MEASURE.format(threads=threads, model=model, tokens=tokens), timeout=600)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs="+", type=Path, default=[Path(".")])
    ap.add_argument("--model", default=os.path.join(os.environ.get("PAGEDECODE_SHARED", "/work/shared"), "models", "stories260k"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    results: dict[tuple[str, str], list[float]] = {}
    for rep in range(args.repeats):
        for condition in ("idle", "neighbour"):
            with busy_neighbours(1 if condition == "neighbour" else 0):
                for tree in args.trees:
                    r = run(tree.resolve(), args.model, args.threads, args.tokens)
                    results.setdefault((str(tree), condition), []).append(r["tokens_per_s"])
                    print(f"repeat {rep} {condition:9s} {str(tree):24s} {r['tokens_per_s']:8.1f} tok/s "
                          f"(compiled forward: {r['cpu_ext']}; load {load()})", flush=True)
    print(f"\nmedian tokens/s, stories260k single stream, {args.threads} threads, {args.tokens} tokens:")
    for tree in args.trees:
        idle = statistics.median(results[(str(tree), "idle")])
        busy_tps = statistics.median(results[(str(tree), "neighbour")])
        print(f"  {str(tree):24s} idle {idle:8.1f}   neighbour {busy_tps:8.1f}   kept {busy_tps / idle:.2f}")


if __name__ == "__main__":
    main()
