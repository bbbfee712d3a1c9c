"""What a speculative verify costs: one sequence's forward of T new rows over a cached context
(the rows a verify scores), as a multiple of a 1-row decode step, on SmolLM2-135M-Instruct (float32
or bfloat16, from its F32 GGUF), idle and beside a busy neighbour (one `python -c 'while 1: pass'`
per core but one). Speculation pays when T rows cost far less than T decode steps; the neighbour
case shows whether the forward's threads wait on a core another process holds.

    python benchmarks/verify_cost.py                                  # float32, 2 threads
    python benchmarks/verify_cost.py --dtype bfloat16 --trees /work/main /tmp/old   # side by side

Each tree (a source checkout with its compiled extension) is measured in its own process, trees
alternating within each repeat so the machine's other load falls on all alike. Minimum over
--repeat forwards per T; `uptime`'s load printed beside each. JSON + PNG under benchmarks/results/.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import busy_neighbours, plot, result_path, run_in_tree, write_json  # noqa: E402
from real_model import smollm2_f32_gguf  # noqa: E402

MEASURE = """
import json, time, torch
import pagedecode as pd
from pagedecode.model.batch import ForwardBatch
eng = pd.Engine.from_pretrained({model!r}, device="cpu", dtype=torch.{dtype}, max_batch_size=8, num_threads={threads})
model, kv, ps, ctx = eng.model, eng.kv, eng.config.page_size, {context}
pages = list(range(1, (ctx + 64) // ps + 2))

def batch(start, n):
    pos = torch.arange(start, start + n)
    slots = torch.tensor([pages[p // ps] * ps + p % ps for p in pos.tolist()])
    return ForwardBatch(torch.randint(100, 1000, (n,)), pos, slots, torch.tensor([pages], dtype=torch.int32),
                        torch.tensor([start + n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32),
                        torch.arange(n), num_decode=int(n == 1), max_new=n)

best = {{}}
with torch.inference_mode():
    model.forward(batch(0, ctx), kv)
    for _ in range({repeat}):
        for rows in {rows}:
            b = batch(ctx, rows)
            t = time.perf_counter()
            model.forward(b, kv)
            best[rows] = min(best.get(rows, 1e9), time.perf_counter() - t)
print(json.dumps({{str(r): 1e3 * s for r, s in best.items()}}))
"""


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def measure(tree: str, args: argparse.Namespace) -> dict[str, float]:
    return run_in_tree(tree, MEASURE.format(model=str(smollm2_f32_gguf()), dtype=args.dtype, threads=args.threads,
                                            context=args.context, repeat=args.repeat, rows=args.rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs="+", default=[str(Path(__file__).resolve().parent.parent)])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=200, help="cached tokens before the verified rows")
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 5, 7, 8, 12, 17, 24])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2, help="passes over the trees (the minimum is kept)")
    ap.add_argument("--no-neighbour", action="store_true", help="idle only")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    path = result_path("verify-cost", args.out)
    modes = ["idle"] + ([] if args.no_neighbour else ["neighbour"])
    result: dict = {"dtype": args.dtype, "threads": args.threads, "context": args.context, "rows": args.rows,
                    "trees": args.trees, "ms": {}, "load": {}}
    for mode in modes:
        with busy_neighbours(max(1, (os.cpu_count() or 2) - 1) if mode == "neighbour" else 0):
            for _ in range(args.rounds):
                for tree in args.trees:
                    key = f"{mode} {tree}"
                    print(f"[{mode}] {tree} (load {load()})", flush=True)
                    ms = measure(tree, args)
                    old = result["ms"].get(key, {})
                    result["ms"][key] = {r: min(v, old.get(r, v)) for r, v in ms.items()}
                    result["load"].setdefault(key, []).append(load())
    write_json(path, result)

    def draw(ax):
        for key, ms in result["ms"].items():
            ax.plot(args.rows, [ms[str(r)] / ms["1"] for r in args.rows], marker="o", label=key)
        ax.plot(args.rows, args.rows, ls=":", color="grey", label="T decode steps")
        ax.set_xlabel("rows in one forward (a verify of T - 1 drafts)")
        ax.set_ylabel("cost / 1-row forward")
        ax.set_yscale("log")
        ax.set_title(f"SmolLM2 {args.dtype}, {args.threads} threads, {args.context} cached tokens")
        ax.legend(fontsize=7)
    plot(path, draw, size=(8, 5))
    print(f"{'case':60} " + " ".join(f"{'T=' + str(r):>9}" for r in args.rows))
    for key, ms in result["ms"].items():
        print(f"{key[-60:]:60} " + " ".join(f"{ms[str(r)]:7.1f}ms" for r in args.rows))
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
