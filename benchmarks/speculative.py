"""Speculative decoding (n-gram prompt lookup) on vs off, in one run, interleaved.

    .venv/bin/python benchmarks/speculative.py [--workloads a,b,c] [--repeat 2] [--k 4] [--out FILE]
    .venv/bin/python benchmarks/speculative.py --kernel [--out FILE]     # the rejection kernel on CUDA

Workloads (greedy):
  a  stories260k story continuation: short story openings, 256 tokens each
  b  input-grounded: stories260k prompted with a passage it then reproduces (an opening, its own
     200-token greedy continuation, then the opening again), 200 tokens each
  c  the random 135M Llama (SmolLM-135M's shape, benchmarks/engine_vs_hf.py): text with little
     repetition, 48 tokens each from 32 random prompt ids
each single stream (one request at a time) and 16 concurrent requests. Off and on runs alternate
(the machine may be shared: the load average is recorded before and after each run); medians
of --repeat runs are reported, by wall time and by the process's CPU time (steadier on a shared
machine). Outputs must be identical on and off (checked). Per case: output
tokens/s, the ratio, acceptance (accepted / proposed draft tokens) and tokens per verify step
((accepted + verify runs) / verify runs). llama.cpp's `llama-lookup` (benchmarks/peers/llamacpp.sh
builds it) runs the single-stream stories260k cases too when it is built. JSON under
benchmarks/results/ and a PNG beside it; progress on stderr.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import pagedecode as pd
from common import plot, result_path, write_json

HERE = Path(__file__).resolve().parent
LLAMACPP = Path(os.environ.get("PAGEDECODE_LLAMACPP", HERE / ".cache" / "llamacpp"))
OPENINGS = ["Once upon a time", "Lily and Tom went to the park", "The little cat", "One day, a boy named Sam"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load() -> float:
    return os.getloadavg()[0]


def stories_dir() -> Path:
    for c in (os.environ.get("PAGEDECODE_STORIES"), HERE.parent.parent / "shared" / "models" / "stories260k",
              HERE.parent / "tests" / "models" / "stories260k"):
        if c and (Path(c) / "model.safetensors").is_file():
            return Path(c)
    raise SystemExit("stories260k not found: set PAGEDECODE_STORIES to its folder")


def workloads(names: list[str]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    if "a" in names or "b" in names:
        stories = stories_dir()
        if "a" in names:
            out["a"] = {"model": str(stories), "prompts": OPENINGS, "max_tokens": 256}
        if "b" in names:
            eng = pd.Engine.from_pretrained(stories)
            conts = [o.text for o in eng.generate(OPENINGS, pd.SamplingParams(max_tokens=200))]
            out["b"] = {"model": str(stories), "prompts": [p + c + "\n" + p for p, c in zip(OPENINGS, conts)],
                        "max_tokens": 200}
    if "c" in names:
        sys.path.insert(0, str(HERE))
        from engine_vs_hf import llama135m_dir
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 49152, (32,), generator=g).tolist() for _ in OPENINGS]
        out["c"] = {"model": str(llama135m_dir()), "prompts": prompts, "max_tokens": 48}
    return out


def run_once(engine: pd.Engine, prompts: list, max_tokens: int, concurrent: int) -> dict:
    params = pd.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    before = engine.snapshot()
    c0, t0 = time.process_time(), time.perf_counter()
    if concurrent == 1:
        outs = [engine.generate([p], params)[0] for p in prompts]
    else:
        outs = engine.generate([prompts[i % len(prompts)] for i in range(concurrent)], params)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    after = engine.snapshot()
    tokens = sum(len(o.selected_token_ids) for o in outs)
    drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
    proposed = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    return {"wall_s": wall, "cpu_s": cpu, "tokens": tokens, "tokens_per_s": tokens / wall,
            "tokens_per_cpu_s": tokens / cpu, "steps": after.steps - before.steps,
            "verify_runs": drafts, "draft_tokens": proposed, "accepted_tokens": accepted,
            "acceptance": accepted / proposed if proposed else None,
            "tokens_per_verify": (accepted + drafts) / drafts if drafts else None,
            "mean_accepted": accepted / drafts if drafts else None,
            "outputs": [o.selected_token_ids for o in outs]}


def llama_lookup(model_gguf: Path, prompt: str, n: int, k: int) -> dict | None:
    tool = LLAMACPP / "bin" / "llama-lookup"
    if not tool.is_file() or not model_gguf.is_file():
        return None
    r = subprocess.run([str(tool), "-m", str(model_gguf), "-p", prompt, "-n", str(n), "--temp", "0",
                        "-t", str(torch.get_num_threads()),
                        "--spec-draft-n-max", str(k), "-c", "512"], capture_output=True, text=True, timeout=300)
    text = r.stdout + r.stderr
    speed = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", text)
    drafted = re.search(r"n_drafted\s*=\s*(\d+)", text)
    accept = re.search(r"n_accept\s*=\s*(\d+)", text)
    if not speed:
        return {"error": text[-400:]}
    return {"tokens": int(speed.group(1)), "seconds": float(speed.group(2)), "tokens_per_s": float(speed.group(3)),
            "draft_tokens": int(drafted.group(1)) if drafted else None,
            "accepted_tokens": int(accept.group(1)) if accept else None}


def bench(args: argparse.Namespace) -> dict:
    cases = []
    spec = pd.SpeculativeConfig(method="ngram", num_tokens=args.k, min_ngram=2, max_ngram=4)
    for name, w in workloads(args.workloads.split(",")).items():
        engines = {on: pd.Engine.from_pretrained(w["model"], max_batch_size=16, speculative=spec if on else None)
                   for on in (False, True)}
        for eng in engines.values():                       # warm-up: first-call costs out of the timing
            eng.generate([w["prompts"][0]], pd.SamplingParams(max_tokens=8))
        for concurrent in (1, 16):
            runs: dict[bool, list[dict]] = {False: [], True: []}
            for rep in range(args.repeat):
                for on in ((False, True) if rep % 2 == 0 else (True, False)):
                    la = load()
                    r = run_once(engines[on], w["prompts"], w["max_tokens"], concurrent)
                    r["load_before"], r["load_after"] = la, load()
                    runs[on].append(r)
                    log(f"{name} x{concurrent} spec={'on' if on else 'off'} run {rep + 1}: "
                        f"{r['tokens_per_s']:.1f} tok/s (load {la:.1f})")
            same = all(r["outputs"] == runs[False][0]["outputs"] for r in runs[True] + runs[False])
            for rs in runs.values():
                for r in rs:
                    del r["outputs"]
            med = {on: {key: statistics.median(r[key] for r in rs) for key in ("tokens_per_s", "tokens_per_cpu_s")}
                   for on, rs in runs.items()}
            last = runs[True][-1]
            case = {"workload": name, "concurrent": concurrent, "identical_outputs": same,
                    "off_tokens_per_s": med[False]["tokens_per_s"], "on_tokens_per_s": med[True]["tokens_per_s"],
                    "speedup": med[True]["tokens_per_s"] / med[False]["tokens_per_s"],
                    "speedup_cpu": med[True]["tokens_per_cpu_s"] / med[False]["tokens_per_cpu_s"],
                    "acceptance": last["acceptance"], "tokens_per_verify": last["tokens_per_verify"],
                    "mean_accepted": last["mean_accepted"], "verify_runs": last["verify_runs"],
                    "steps_on": last["steps"], "steps_off": runs[False][-1]["steps"],
                    "load": [r["load_before"] for rs in runs.values() for r in rs],
                    "runs": {"off": runs[False], "on": runs[True]}}
            if name in ("a", "b") and concurrent == 1:
                gguf = LLAMACPP / "stories260k.f32.gguf"
                peer = [llama_lookup(gguf, p, w["max_tokens"], args.k) for p in w["prompts"]]
                if all(p is not None and "error" not in p for p in peer):
                    t = sum(p["tokens"] for p in peer)
                    d = sum(p["draft_tokens"] or 0 for p in peer)
                    a = sum(p["accepted_tokens"] or 0 for p in peer)
                    case["llama_lookup"] = {"tokens_per_s": t / sum(p["seconds"] for p in peer),
                                            "acceptance": a / d if d else None, "runs": peer}
                elif peer and peer[0] is not None:
                    case["llama_lookup"] = {"error": next(p for p in peer if p and "error" in p)["error"]}
            log(f"{name} x{concurrent}: speedup {case['speedup']:.2f}, acceptance {case['acceptance']}, "
                f"identical {same}")
            cases.append(case)
    return {"benchmark": "speculative", "date": time.strftime("%Y-%m-%d %H:%M"), "k": args.k,
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()},
            "cases": cases}


def kernel(args: argparse.Namespace) -> dict:
    """The rejection kernel on CUDA against its torch reference: equal tokens, and time."""
    from pagedecode.kernels.rejection import rejection_sample
    rows = []
    for B, K, V in ((1, 4, 32000), (64, 4, 32000), (64, 8, 128256)):
        g = torch.Generator().manual_seed(0)
        target = torch.softmax(torch.randn(B, K + 1, V, generator=g), -1).cuda()
        draft = torch.softmax(torch.randn(B, K, V, generator=g), -1).cuda()
        ids = torch.multinomial(draft.reshape(-1, V).cpu(), 1, generator=g).reshape(B, K).cuda()
        n = torch.full((B,), K, dtype=torch.int32, device="cuda")
        seed, index = torch.arange(B, device="cuda"), torch.zeros(B, dtype=torch.int64, device="cuda")
        row: dict = {"B": B, "K": K, "V": V}
        for backend in ("triton", "torch"):
            out = rejection_sample(target, draft, ids, n, seed, index, backend=backend)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                out = rejection_sample(target, draft, ids, n, seed, index, backend=backend)
            torch.cuda.synchronize()
            row[f"{backend}_us"] = (time.perf_counter() - t0) / 20 * 1e6
            row[f"{backend}_tokens"] = out.tokens.cpu().tolist()
        row["equal"] = row.pop("triton_tokens") == row.pop("torch_tokens")
        rows.append(row)
        print(row, flush=True)
    return {"benchmark": "speculative-kernel", "device": torch.cuda.get_device_name(), "rows": rows}


def draw(result: dict):
    def inner(axes):
        cases = result["cases"]
        labels = [f"{c['workload']} x{c['concurrent']}" for c in cases]
        x = range(len(cases))
        axes.bar([i - 0.2 for i in x], [c["off_tokens_per_s"] for c in cases], 0.4, label="off")
        axes.bar([i + 0.2 for i in x], [c["on_tokens_per_s"] for c in cases], 0.4, label="n-gram on")
        for i, c in enumerate(cases):
            axes.text(i, max(c["off_tokens_per_s"], c["on_tokens_per_s"]), f"{c['speedup']:.2f}x",
                      ha="center", va="bottom")
        axes.set_xticks(list(x), labels)
        axes.set_yscale("log")
        axes.set_ylabel("output tokens/s")
        axes.set_title(f"speculative decoding, k = {result['k']} (a: stories, b: grounded, c: random 135M)")
        axes.legend()
    return inner


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="a,b,c")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--k", type=int, default=4, help="draft tokens per step")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's); 1 on a shared machine, where parallel regions of "
                         "the multi-row matmuls a verify step runs wait on descheduled threads")
    ap.add_argument("--kernel", action="store_true", help="time the rejection kernel on CUDA instead")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.kernel:
        result = kernel(args)
        write_json(result_path("speculative-kernel", args.out), result)
        return 0 if all(r["equal"] for r in result["rows"]) else 1
    if args.threads:
        torch.set_num_threads(args.threads)
    result = bench(args)
    path = result_path("speculative", args.out)
    write_json(path, result)
    plot(path, draw(result))
    print(f"{'case':10} {'off tok/s':>10} {'on tok/s':>10} {'ratio':>6} {'cpu':>6} {'accept':>7} {'mean acc':>8} "
          f"{'tok/verify':>10} {'load':>9}")
    for c in result["cases"]:
        def f(v):
            return f"{v:.2f}" if v is not None else "-"
        print(f"{c['workload'] + ' x' + str(c['concurrent']):10} {c['off_tokens_per_s']:10.1f} "
              f"{c['on_tokens_per_s']:10.1f} {c['speedup']:6.2f} {c['speedup_cpu']:6.2f} {f(c['acceptance']):>7} "
              f"{f(c['mean_accepted']):>8} {f(c['tokens_per_verify']):>10} "
              f"{min(c['load']):4.1f}-{max(c['load']):.1f}")
    print(f"written {path}")
    return 0 if all(c["identical_outputs"] for c in result["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
