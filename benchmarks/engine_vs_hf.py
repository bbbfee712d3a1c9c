"""pagedecode vs transformers' generate (and llama.cpp when built), same checkpoint and workload, one run.

Workloads
  single  one request: 64-token prompt, 128 new tokens (each engine: the median of --repeat runs)
  mixed   64 requests, prompt lengths 16-512 and output lengths 16-256 (seeded). transformers
          runs them in padded batches (sorted by prompt length, --hf-batch at a time); only the
          tokens each request asked for count as useful. llama.cpp runs llama-batched-bench
          with 64 sequences of the mean prompt and mean output length (its tool has no mixed
          lengths: the same useful tokens, every sequence busy to the end)
Models (--models, comma-separated; or --model DIR for one checkpoint of your own)
  stories260k  a real trained Llama: --stories DIR, else $PAGEDECODE_STORIES, else
               $PAGEDECODE_SHARED/models/stories260k (a clear error when none holds it)
  llama135m    a random Llama of SmolLM-135M's shape (hidden 576, 30 layers, 9 / 3 heads, vocab
               49152), written by transformers under benchmarks/.cache on first use

Every engine runs greedy with EOS ignored, in --dtype on --device with --threads CPU threads
(llama.cpp: the same -t). Reported per engine: useful tokens/s, and for pagedecode and
transformers the time to first token and inter-token latency p50/p90/p99 (from the moment each
token reaches the caller: pagedecode's events, transformers' streamer), the ratio to
transformers, whether the greedy tokens agree, and pagedecode's decode batch size over the
run. JSON and a PNG go to benchmarks/results/engine_vs_hf-<date>-<time>.json unless --out.

llama.cpp: `benchmarks/peers/llamacpp.sh` builds it (from the llama-cpp-python sdist on PyPI)
into benchmarks/.cache/llamacpp; this script converts each checkpoint with llama.cpp's own
converter on first use. --engines picks engines (default: all that are available).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

import torch

import pagedecode as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import plot, result_path, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent
LLAMACPP = ROOT / ".cache" / "llamacpp"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def progress(total: int, desc: str, unit: str = "tok") -> Any:
    try:
        from tqdm import tqdm
    except ImportError:                     # make bench installs it; without it, no bar
        class Quiet:
            def update(self, n: int = 1) -> None: ...
            def close(self) -> None: ...
        return Quiet()
    return tqdm(total=total, desc=desc, unit=unit, leave=False, file=sys.stderr, mininterval=0.5)


# -- models ---------------------------------------------------------------------------------
def stories_dir(option: str | None) -> Path:
    candidates = [Path(option)] if option else []
    if os.environ.get("PAGEDECODE_STORIES"):
        candidates.append(Path(os.environ["PAGEDECODE_STORIES"]))
    if os.environ.get("PAGEDECODE_SHARED"):
        candidates.append(Path(os.environ["PAGEDECODE_SHARED"]) / "models" / "stories260k")
    for c in candidates:
        if (c / "model.safetensors").is_file():
            return c
    tried = ", ".join(str(c) for c in candidates) or "nothing given"
    raise SystemExit(f"stories260k not found (tried: {tried}). Pass --stories DIR or set PAGEDECODE_STORIES "
                     "to a Hugging Face folder holding it, or leave it out: --models llama135m")


def llama135m_dir() -> Path:
    path = ROOT / ".cache" / "llama135m"
    if not (path / "model.safetensors").is_file():
        import transformers
        from pagedecode.model.default_model import default_model_path
        cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                       num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                       max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                       bos_token_id=1, eos_token_id=2, initializer_range=0.06)
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
        for f in ("tokenizer.json", "tokenizer_config.json"):     # prompts are ids; any tokenizer loads
            src = default_model_path() / f
            if src.is_file():
                shutil.copy(src, path / f)
    return path


def model_dirs(args: argparse.Namespace) -> list[tuple[str, Path]]:
    if args.model:
        path = Path(args.model)
        if not (path / "config.json").is_file():
            raise SystemExit(f"--model {path}: no config.json there (a Hugging Face checkpoint folder)")
        return [(path.name, path)]
    out = []
    for name in args.models.split(","):
        if name == "stories260k":
            out.append((name, stories_dir(args.stories)))
        elif name == "llama135m":
            out.append((name, llama135m_dir()))
        else:
            raise SystemExit(f"unknown model {name!r}: stories260k, llama135m, or --model DIR")
    return out


def workload(name: str, vocab: int, context: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    if name == "single":
        return [([1] + [rng.randrange(3, min(vocab, 512)) for _ in range(63)], 128)]
    reqs = []
    for _ in range(64):
        p = rng.randint(16, 512)
        o = rng.randint(16, 256)
        scale = min(1.0, (context - 1) / (p + o))          # stories260k has a 512-token context
        p, o = max(1, int(p * scale)), max(1, int(o * scale))
        reqs.append(([1] + [rng.randrange(3, min(vocab, 512)) for _ in range(p - 1)], o))
    return reqs


# -- latency --------------------------------------------------------------------------------
def percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    xs = sorted(values)

    def at(q: float) -> float:
        return round(1e3 * xs[min(len(xs) - 1, int(q * len(xs)))], 3)
    return {"p50_ms": at(0.50), "p90_ms": at(0.90), "p99_ms": at(0.99)}


def latency(t0: float, arrivals: list[list[float]]) -> dict[str, Any]:
    """arrivals[i]: when request i's tokens reached the caller (one entry per delivery)."""
    ttft = [a[0] - t0 for a in arrivals if a]
    itl = [b - a for times in arrivals for a, b in zip(times, times[1:])]
    return {"ttft": percentiles(ttft), "itl": percentiles(itl)}


# -- engines --------------------------------------------------------------------------------
def run_pagedecode(path: Path, reqs: list, device: str, dtype: str, quantization: str | None = None,
                   **options: Any) -> dict[str, Any]:
    """`path`: a checkpoint folder or a GGUF file (benchmarks/quantized.py); `quantization` and
    `options` (EngineConfig's) as Engine.from_pretrained takes them."""
    total = sum(len(p) + o for p, o in reqs)
    engine = pd.Engine.from_pretrained(path, device=device, dtype=DTYPES[dtype], max_batch_size=64,
                                       max_cache_tokens=total + 64 * 16, max_tokens_per_step=2048,
                                       quantization=quantization, **options)
    weight_bytes = engine.weight_bytes
    # warm-up as llama-bench's (a prompt run of the test's length, then a generated token): the first
    # prompt's length in other token ids (no prefix-cache hit). The first step of a size grows the
    # heap the later ones reuse, and this machine's first touch of fresh pages is slow: after an
    # 8-token warm-up the first 64-token prefill of SmolLM2 took 3-4x the next ones (~1,700 page faults)
    first = reqs[0][0]
    warm = [first[0]] + [3 + (t + 101) % 400 for t in first[1:]]
    engine.generate([warm], pd.SamplingParams(max_tokens=2, ignore_eos=True))
    pd.freeze_heap()                                    # as `pagedecode serve` runs (runtime/process.py)
    bar = progress(sum(o for _, o in reqs), "pagedecode")
    t0 = time.perf_counter()
    rids = [engine.add_request(p, pd.SamplingParams(max_tokens=o, ignore_eos=True)) for p, o in reqs]
    index = {rid: i for i, rid in enumerate(rids)}
    arrivals: list[list[float]] = [[] for _ in reqs]
    decode_batch: list[int] = []
    last = engine.step_records[-1]["step"] if engine.step_records else 0
    while engine.has_unfinished():
        events = engine.step()
        now = time.perf_counter()
        if engine.step_records and engine.step_records[-1]["step"] != last:
            last = engine.step_records[-1]["step"]
            decode_batch.append(engine.step_records[-1]["decode"])
        for ev in events:
            if isinstance(ev, pd.DeltaEvent) and ev.token_ids:
                arrivals[index[ev.request_id]].append(now)
                bar.update(len(ev.token_ids))
    elapsed = time.perf_counter() - t0
    bar.close()
    tokens = [engine.result(r).selected_token_ids for r in rids]
    backend = "compiled C++ (csrc/cpu_forward.cpp)" if getattr(engine.model, "uses_cpu_extension", lambda: False)() \
        else "torch / triton"
    engine.close()
    import gc
    gc.unfreeze()
    nonzero = [b for b in decode_batch if b]
    return {"seconds": elapsed, "tokens": tokens, **latency(t0, arrivals), "forward": backend,
            "weight_bytes": weight_bytes,
            "decode_batch": {"mean": round(statistics.mean(nonzero), 1) if nonzero else 0,
                             "max": max(decode_batch, default=0), "steps": len(decode_batch),
                             "per_step": decode_batch}}


class _Clock:
    """A transformers streamer that notes when each step's tokens come out."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt = True

    def put(self, value: torch.Tensor) -> None:
        if self._prompt:                  # the first put is the prompt itself
            self._prompt = False
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_transformers(path: Path, reqs: list, batch: int, device: str, dtype: str) -> dict[str, Any]:
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to(device).eval()
    order = sorted(range(len(reqs)), key=lambda i: len(reqs[i][0]))
    tokens: list[list[int]] = [[] for _ in reqs]
    arrivals: list[list[float]] = [[] for _ in reqs]
    bar = progress(sum(o for _, o in reqs), "transformers")
    with torch.inference_mode():
        model.generate(torch.tensor([reqs[0][0][:8]], device=device), max_new_tokens=4, do_sample=False,
                       eos_token_id=None)
        t0 = time.perf_counter()
        for at in range(0, len(order), batch):
            group = order[at:at + batch]
            width = max(len(reqs[i][0]) for i in group)
            ids = torch.zeros(len(group), width, dtype=torch.long)
            mask = torch.zeros(len(group), width, dtype=torch.long)
            for row, i in enumerate(group):                    # left padding
                p = reqs[i][0]
                ids[row, width - len(p):] = torch.tensor(p)
                mask[row, width - len(p):] = 1
            new = max(reqs[i][1] for i in group)
            clock = _Clock()
            out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                                 do_sample=False, eos_token_id=None, pad_token_id=0, streamer=clock)
            for row, i in enumerate(group):
                tokens[i] = out[row, width:width + reqs[i][1]].tolist()
                arrivals[i] = clock.times[:reqs[i][1]]
            bar.update(sum(reqs[i][1] for i in group))
        elapsed = time.perf_counter() - t0
    bar.close()
    return {"seconds": elapsed, "tokens": tokens, **latency(t0, arrivals)}


def transformers_in_child(threads: int, *args: Any) -> dict[str, Any]:
    """run_transformers in a fresh process: nothing pagedecode set in this one (its CPU forward
    sets glibc's malloc thresholds for the process; the heap it leaves) applies to transformers."""
    import multiprocessing
    pool = multiprocessing.get_context("spawn").Pool(1)
    try:
        return pool.apply(_transformers_with_threads, (threads, *args))
    finally:                       # close + join, not terminate: the child exits on its own
        pool.close()
        pool.join()


def _transformers_with_threads(threads: int, *args: Any) -> dict[str, Any]:
    torch.set_num_threads(threads)
    return run_transformers(*args)


def llamacpp_gguf(path: Path, dtype: str) -> Path | None:
    """The checkpoint converted by llama.cpp's own script (once), or None without a build."""
    if not (LLAMACPP / "bin" / "llama-bench").is_file():
        return None
    outtype = {"float32": "f32", "bfloat16": "bf16"}[dtype]
    out = LLAMACPP / f"{path.name}.{outtype}.gguf"
    if not out.is_file():
        env = {"PYTHON": sys.executable, **os.environ}     # its converter runs in this interpreter
        if path == ROOT / ".cache" / "llama135m":   # its small byte-level BPE is not in llama.cpp's table
            env["LLAMACPP_PRE"] = "gpt-2"
        subprocess.run([str(ROOT / "peers" / "llamacpp.sh"), "convert", str(path), str(out), outtype], check=True,
                       stdout=subprocess.DEVNULL, env=env)
    return out


def run_llamacpp(gguf: Path, reqs: list, threads: int, repeat: int) -> dict[str, Any]:
    """single: llama-bench's prompt+generation test; mixed: llama-batched-bench (uniform lengths)."""
    useful = sum(o for _, o in reqs)
    if len(reqs) == 1:
        p, o = len(reqs[0][0]), reqs[0][1]
        cmd = [str(LLAMACPP / "bin" / "llama-bench"), "-m", str(gguf), "-p", "0", "-n", "0", "-pg", f"{p},{o}",
               "-t", str(threads), "-r", str(repeat), "-o", "json"]
        res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        seconds = (p + o) / res[-1]["avg_ts"]                 # avg_ts counts prompt and generated tokens
        return {"seconds": seconds, "tool": "llama-bench -pg", "command": " ".join(cmd[1:])}
    n = len(reqs)
    npp = round(sum(len(p) for p, _ in reqs) / n)
    ntg = round(useful / n)
    cmd = [str(LLAMACPP / "bin" / "llama-batched-bench"), "-m", str(gguf), "-c", str(n * (npp + ntg) + 256),
           "-b", "2048", "-ub", "512", "-npp", str(npp), "-ntg", str(ntg), "-npl", str(n), "-t", str(threads),
           "-tb", str(threads), "--output-format", "jsonl"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    row = [json.loads(line) for line in out.splitlines() if line.startswith("{")][-1]
    return {"seconds": row["t"], "tool": f"llama-batched-bench {n} x ({npp} prompt + {ntg} generated)",
            "command": " ".join(cmd[1:])}


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="stories260k,llama135m")
    ap.add_argument("--model", help="one Hugging Face checkpoint folder instead of --models")
    ap.add_argument("--stories", help="the stories260k folder (else $PAGEDECODE_STORIES / $PAGEDECODE_SHARED)")
    ap.add_argument("--workloads", default="single,mixed")
    ap.add_argument("--engines", default="pagedecode,transformers,llamacpp")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="CPU threads, every engine")
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5, help="runs of the single workload (the median is kept)")
    ap.add_argument("--out", help="the JSON path (default: a new file under benchmarks/results/)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    engines = args.engines.split(",")
    out = result_path(f"engine_vs_hf-{args.device}-{args.dtype}", args.out)
    rows: list[dict[str, Any]] = []
    result = {"date": str(date.today()), "device": args.device, "dtype": args.dtype, "threads": args.threads,
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
              "python": sys.version.split()[0], "torch": torch.__version__, "results": rows}
    for mname, path in model_dirs(args):
        cfg = json.loads((path / "config.json").read_text())
        gguf = llamacpp_gguf(path, args.dtype) if "llamacpp" in engines and args.device == "cpu" else None
        for wname in args.workloads.split(","):
            reqs = workload(wname, cfg["vocab_size"], cfg.get("max_position_embeddings", 2048))
            useful = sum(o for _, o in reqs)
            repeat = args.repeat if wname == "single" else 1
            row: dict[str, Any] = {"model": mname, "workload": wname, "requests": len(reqs), "useful_tokens": useful,
                                   "hf_batch": args.hf_batch if wname == "mixed" else 1}
            got: dict[str, dict[str, Any]] = {}
            if "pagedecode" in engines:
                got["pagedecode"] = median_run([run_pagedecode(path, reqs, args.device, args.dtype)
                                                for _ in range(repeat)])
            if "transformers" in engines:
                got["transformers"] = median_run([transformers_in_child(args.threads, path, reqs, row["hf_batch"],
                                                                        args.device, args.dtype)
                                                  for _ in range(repeat)])
            if gguf is not None:
                got["llamacpp"] = run_llamacpp(gguf, reqs, args.threads, repeat)
            for name, r in got.items():
                row[name] = {k: v for k, v in r.items() if k != "tokens"}
                row[name]["seconds"] = round(r["seconds"], 3)
                row[name]["tok_s"] = round(useful / r["seconds"], 1)
            if "transformers" in got:
                for name in got:
                    row[name]["vs_transformers"] = round(got["transformers"]["seconds"] / got[name]["seconds"], 2)
            if "pagedecode" in got and "transformers" in got:
                a, b = got["pagedecode"]["tokens"], got["transformers"]["tokens"]
                same = sum(x == y for x, y in zip(a, b))
                agree = sum(sum(u == v for u, v in zip(x, y)) for x, y in zip(a, b))
                row["identical_requests"] = f"{same}/{len(reqs)}"
                row["token_agreement"] = round(agree / useful, 4)
            if "pagedecode" in got and "llamacpp" in got:
                row["pagedecode_vs_llamacpp"] = round(got["llamacpp"]["seconds"] / got["pagedecode"]["seconds"], 2)
            rows.append(row)
            line = "  ".join(f"{n} {row[n]['tok_s']:>9.1f} tok/s" for n in got)
            extra = f"  identical {row['identical_requests']}" if "identical_requests" in row else ""
            ratio = f"  {row['pagedecode']['vs_transformers']}x transformers" if "vs_transformers" in row.get(
                "pagedecode", {}) else ""
            ratio += f"  {row['pagedecode_vs_llamacpp']}x llama.cpp" if "pagedecode_vs_llamacpp" in row else ""
            print(f"{mname:<12} {wname:<7} {line}{ratio}{extra}", flush=True)
            write_json(out, result)                       # as it goes: a cut-off run keeps its rows
    plot(out, lambda axes: draw(axes, rows, result), size=(12, 4.5), ncols=2)
    print(f"wrote {out} (+ .png)")
    return 0


def draw(axes: Any, rows: list[dict[str, Any]], result: dict[str, Any]) -> None:
    left, right = axes
    names = [n for n in ("pagedecode", "transformers", "llamacpp") if any(n in r for r in rows)]
    width = 0.8 / max(1, len(names))
    for k, name in enumerate(names):
        xs = [i + k * width for i, r in enumerate(rows) if name in r]
        ys = [r[name]["tok_s"] for r in rows if name in r]
        left.bar(xs, ys, width, label=name)
    left.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))])
    left.set_xticklabels([f"{r['model']}\n{r['workload']}" for r in rows])
    left.set_yscale("log")
    left.set_ylabel("useful tokens/s (log)")
    left.set_title(f"{result['device']} {result['dtype']}, {result['threads']} threads, {result['date']}")
    left.legend()
    for r in rows:
        if r["workload"] == "mixed" and "pagedecode" in r:
            right.plot(r["pagedecode"]["decode_batch"]["per_step"], label=r["model"])
    right.set_xlabel("step")
    right.set_ylabel("decode batch size")
    right.set_title("pagedecode, mixed workload: sequences decoding per step")
    if right.lines:
        right.legend()


if __name__ == "__main__":
    sys.exit(main())
