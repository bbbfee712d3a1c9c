"""pagedecode vs llama.cpp on llama.cpp's own formats: one GGUF file per format, both engines, one run.

    python benchmarks/quantized.py                        # stories260k and llama135m, every format
    python benchmarks/quantized.py --models stories260k --formats f32,q8_0 --workloads single --repeat 1
    python benchmarks/quantized.py --models smollm2       # the real model, every block type (issue 35.7)
    python benchmarks/quantized.py --quick                # the real model: its Q4_1 file and Q4_K_M, once each

Files  llama.cpp's convert script writes the checkpoint as an f32 GGUF; llama-quantize from the
       same build makes bf16 / q8_0 / q4_0 from it (--pure: every matrix in that type, the tied
       embedding / LM head included). pagedecode and llama.cpp load the same file. pagedecode
       computes in float32 (bfloat16 for bf16) with the quantized blocks kept as they are, on a
       float16 KV cache (--kv-cache-dtype) as llama.cpp's default (bf16: its own bfloat16).
Speed  per format, interleaved: pagedecode, llama.cpp and (float32 / bfloat16 only) transformers
       on engine_vs_hf.py's workloads, --threads threads each: single (64-token prompt + 128
       tokens; llama-bench -pg, the median of --repeat runs) and mixed (64 requests; llama.cpp:
       llama-batched-bench with the mean lengths). Useful tokens/s, and the ratios.
Accuracy  --prompts fixed prompts (seeded token ids) and the float32 file's greedy continuation of
       --accuracy-tokens tokens (on a float32 cache: the reference); each format's logits, on its
       benchmarked KV cache, teacher-forced over it against the reference's:
       max |logit difference| and mean KL(float32 || format) per position. Greedy agreement: the
       fraction of identical tokens (position by position) between pagedecode and llama.cpp
       (benchmarks/peers/greedy.cpp) each decoding greedily from the same prompts and file.
Memory engine.weight_bytes (the weights as pagedecode's forward holds them) and the file size.

Real   --models smollm2: SmolLM2-135M-Instruct's own Q4_1 file and llama-quantize's file of each
model  --real-types type made from its float32 weights (benchmarks/llamacpp_files.py), pagedecode
       (float32 compute on its --kv-cache-dtype cache) and llama.cpp interleaved on each at
       --threads threads: single and mixed as above; tokens/s, the ratio and issue 35's goals
       (single >= 1.0x, mixed >= 1.5x llama.cpp). Its accuracy is benchmarks/llamacpp_accuracy.py's.

Without a llama.cpp build (`benchmarks/peers/llamacpp.sh` makes one) the JSON says why llama.cpp
is left out and pagedecode runs from the Hugging Face folder instead, quantizing at load
(quantization=, its own quantizer: the embedding stays float). JSON + PNG under benchmarks/results/.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
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
import engine_vs_hf as evh  # noqa: E402
import llamacpp_files as lf  # noqa: E402
from common import plot, result_path, write_json  # noqa: E402
from real_model import smollm2_f32_gguf, smollm2_gguf  # noqa: E402
from pagedecode.testing import prefill_batch  # noqa: E402

FORMATS = ("f32", "bf16", "q8_0", "q4_0")
COMPUTE = {"f32": "float32", "bf16": "bfloat16", "q8_0": "float32", "q4_0": "float32"}
TOOLS = ("llama-bench", "llama-batched-bench", "llama-quantize", "pd-greedy")
REAL_TYPES = ("q4_1_file", *lf.QUANTIZE_TYPES)        # q4_1_file: the package's own file


def llamacpp_missing() -> str | None:
    """Why llama.cpp cannot run here, or None."""
    missing = [t for t in TOOLS if not (evh.LLAMACPP / "bin" / t).is_file()]
    if missing:
        return f"llama.cpp not built ({', '.join(missing)} missing from {evh.LLAMACPP / 'bin'}): " \
               "run benchmarks/peers/llamacpp.sh"
    return None


def gguf_files(path: Path, formats: list[str]) -> dict[str, Path]:
    """The checkpoint as llama.cpp's f32 GGUF, and each other format llama-quantize'd from it."""
    f32 = evh.llamacpp_gguf(path, "float32")
    assert f32 is not None
    files = {"f32": f32}
    for fmt in formats:
        if fmt != "f32":
            out = f32.with_name(f32.name.replace(".f32.gguf", f".{fmt}.gguf"))
            subprocess.run([str(evh.ROOT / "peers" / "llamacpp.sh"), "quantize", str(f32), str(out), fmt.upper()],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            files[fmt] = out
    return files


def source(files: dict[str, Path] | None, path: Path, fmt: str, kv_cache_dtype: str) -> dict[str, Any]:
    """Engine.from_pretrained's arguments for a format: its GGUF file, or the folder + quantization=;
    the KV cache asked for where the format computes in float32 (bf16 keeps its own)."""
    kv = kv_cache_dtype if COMPUTE[fmt] == "float32" else "auto"
    if files is not None:
        return {"path": files[fmt], "dtype": COMPUTE[fmt], "quantization": None, "kv_cache_dtype": kv}
    return {"path": path, "dtype": COMPUTE[fmt], "quantization": fmt if fmt in ("q8_0", "q4_0") else None,
            "kv_cache_dtype": kv}


# -- accuracy -------------------------------------------------------------------------------
def prompts(n: int, vocab: int, length: int = 32, seed: int = 1) -> list[list[int]]:
    import random
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, min(vocab, 512)) for _ in range(length - 1)] for _ in range(n)]


def all_logits(engine: Any, ids: list[int]) -> torch.Tensor:
    """Every position's logits, teacher-forced, on a cache of the engine's KV dtype."""
    model, c, page = engine.model, engine.model.config, 16
    pages = (len(ids) + page - 1) // page
    kv = pd.KVCache(c.num_layers, pages, page, c.num_kv_heads, c.head_dim, engine.kv_cache_dtype)
    with torch.inference_mode():
        return model.forward(prefill_batch(ids, pages=list(range(pages)), page_size=page), kv).float()


def greedy(engine: Any, ps: list[list[int]], n: int) -> list[list[int]]:
    outs = engine.generate(ps, pd.SamplingParams(max_tokens=n, ignore_eos=True))
    return [list(o.token_ids) for o in outs]


def llamacpp_greedy(gguf: Path, ps: list[list[int]], n: int, threads: int) -> list[list[int]]:
    text = "".join(" ".join(map(str, p)) + "\n" for p in ps)
    out = subprocess.run([str(evh.LLAMACPP / "bin" / "pd-greedy"), str(gguf), str(n), str(threads)], input=text,
                         check=True, capture_output=True, text=True).stdout
    return [[int(t) for t in line.split()] for line in out.splitlines()]


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    same = sum(u == v for x, y in zip(a, b) for u, v in zip(x, y))
    total = sum(len(x) for x in a)
    return {"token_agreement": round(same / total, 4),
            "identical_prompts": f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"}


def accuracy(engines: dict[str, Any], reference: Any, ps: list[list[int]], n: int, files: dict[str, Path] | None,
             threads: int) -> dict[str, dict[str, Any]]:
    """Per format (each engine on its KV dtype): logits against the reference's (float32 weights and
    cache) over the reference's greedy continuation, and greedy agreement."""
    ref_tokens = greedy(reference, ps, n)
    seqs = [p + t for p, t in zip(ps, ref_tokens)]
    ref = [all_logits(reference, s)[len(p) - 1:len(s) - 1] for p, s in zip(ps, seqs)]
    out = {}
    for fmt, engine in engines.items():
        got = [all_logits(engine, s)[len(p) - 1:len(s) - 1] for p, s in zip(ps, seqs)]
        diff = max(float((g - r).abs().max()) for g, r in zip(got, ref))
        kl = torch.cat([(torch.log_softmax(r, -1).exp() * (torch.log_softmax(r, -1) - torch.log_softmax(g, -1))).sum(-1)
                        for g, r in zip(got, ref)])
        tokens = greedy(engine, ps, n)
        row: dict[str, Any] = {"max_abs_logit_diff": round(diff, 5), "mean_kl": float(f"{float(kl.mean()):.3g}"),
                               "weight_bytes": engine.weight_bytes, "greedy_vs_f32": agreement(tokens, ref_tokens)}
        if files is not None:
            row["file_bytes"] = files[fmt].stat().st_size
            row["greedy_vs_llamacpp"] = agreement(tokens, llamacpp_greedy(files[fmt], ps, n, threads))
        out[fmt] = row
    return out


# -- speed ----------------------------------------------------------------------------------
def run_engine(name: str, src: dict[str, Any], files: dict[str, Path] | None, fmt: str, reqs: list, args: Any,
               path: Path, wname: str) -> dict[str, Any]:
    """One run of one engine on one case, with the load average as it started."""
    load = os.getloadavg()[0]
    if name == "pagedecode":
        r = evh.run_pagedecode(src["path"], reqs, "cpu", src["dtype"], quantization=src["quantization"],
                               kv_cache_dtype=src["kv_cache_dtype"])
        r = {k: v for k, v in r.items() if k != "decode_batch"} | {"decode_batch_mean": r["decode_batch"]["mean"]}
    elif name == "llamacpp":
        assert files is not None
        r = evh.run_llamacpp(files[fmt], reqs, args.threads, 1)
    else:
        r = evh.transformers_in_child(args.threads, path, reqs, args.hf_batch if wname == "mixed" else 1, "cpu",
                                      COMPUTE[fmt])
    return r | {"load": round(load, 2)}


def speed(names: list[str], src: dict[str, Any], files: dict[str, Path] | None, fmt: str, reqs: list, args: Any,
          path: Path, wname: str, repeat: int) -> dict[str, dict[str, Any]]:
    """Every engine on one case, interleaved: pagedecode, llama.cpp, (transformers), pagedecode, ...
    `repeat` rounds; per engine the median run by time, with every run's seconds and load."""
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for _ in range(repeat):
        for n in names:
            runs[n].append(run_engine(n, src, files, fmt, reqs, args, path, wname))
    out = {}
    for n, rs in runs.items():
        out[n] = evh.median_run(rs) | {"runs_seconds": [round(r["seconds"], 3) for r in rs],
                                       "runs_load": [r["load"] for r in rs]}
    return out


def real_model_files(kinds: list[str]) -> dict[str, Path]:
    """SmolLM2's file of each type: the package's own Q4_1, the others llama-quantize'd (cached)."""
    return {k: smollm2_gguf() if k == "q4_1_file" else lf.quantized_file(smollm2_f32_gguf(), k) for k in kinds}


def real_model(args: Any, rows: list[dict[str, Any]], out: Path, result: dict[str, Any]) -> None:
    """Every type of the real model, pagedecode and llama.cpp interleaved per type and workload."""
    kinds = args.real_types.split(",")
    files = real_model_files(kinds)
    vocab, context = 49152, 8192
    workloads = args.workloads.split(",")
    bar = evh.progress(len(workloads) * len(kinds), "quantized.py smollm2", unit="case")
    for wname in workloads:
        reqs = evh.workload(wname, vocab, context)
        useful = sum(o for _, o in reqs)
        repeat = args.repeat if wname == "single" else args.mixed_repeat
        for kind in kinds:
            src = {"path": files[kind], "dtype": "float32", "quantization": None, "kv_cache_dtype": args.kv_cache_dtype}
            got = speed(["pagedecode", "llamacpp"], src, files, kind, reqs, args, files[kind], wname, repeat)
            row: dict[str, Any] = {"model": "smollm2", "workload": wname, "format": kind, "requests": len(reqs),
                                   "useful_tokens": useful, "file_bytes": files[kind].stat().st_size,
                                   "tensor_types": lf.tensor_types(files[kind])}
            for name, r in got.items():
                row[name] = {k: v for k, v in r.items() if k not in ("tokens", "load")}
                row[name]["seconds"] = round(r["seconds"], 3)
                row[name]["tok_s"] = round(useful / r["seconds"], 1)
            row["weight_bytes"] = got["pagedecode"].get("weight_bytes")
            row["pagedecode_vs_llamacpp"] = round(got["llamacpp"]["seconds"] / got["pagedecode"]["seconds"], 2)
            rows.append(row)
            print(f"smollm2      {wname:<7} {kind:<9} tok/s: pagedecode {row['pagedecode']['tok_s']:>8.1f}  llamacpp "
                  f"{row['llamacpp']['tok_s']:>8.1f}  {row['pagedecode_vs_llamacpp']}x llama.cpp  (load "
                  f"{row['pagedecode']['runs_load']} / {row['llamacpp']['runs_load']})", file=sys.stderr, flush=True)
            write_json(out, result)
            bar.update(1)
    bar.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="stories260k,llama135m")
    ap.add_argument("--stories", help="the stories260k folder (else $PAGEDECODE_STORIES / $PAGEDECODE_SHARED)")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--workloads", default="single,mixed")
    ap.add_argument("--engines", default="pagedecode,llamacpp,transformers")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads, every engine")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of the single workload (the median is kept)")
    ap.add_argument("--mixed-repeat", type=int, default=1, help="rounds of the mixed workload")
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--hf-workloads", default="single,mixed", help="the workloads transformers runs")
    ap.add_argument("--prompts", type=int, default=8, help="accuracy: fixed prompts (32 token ids each)")
    ap.add_argument("--accuracy-tokens", type=int, default=32, help="accuracy: greedy tokens per prompt")
    ap.add_argument("--kv-cache-dtype", default="float16", choices=["float16", "bfloat16", "float32"],
                    help="pagedecode's KV cache for the float32-computing formats (f32, q8_0, q4_0; bf16 keeps "
                         "its own): float16 is what llama.cpp holds by default (-ctk / -ctv f16)")
    ap.add_argument("--real-types", default=",".join(REAL_TYPES),
                    help="--models smollm2: the files (q4_1_file, the package's own, and llama-quantize types)")
    ap.add_argument("--quick", action="store_true", help="the real model only: its Q4_1 file and Q4_K_M, "
                    "single and mixed once each")
    ap.add_argument("--note", default="", help="a line kept in the JSON (e.g. what else loaded the machine)")
    ap.add_argument("--out", help="the JSON path (default: a new file under benchmarks/results/)")
    args = ap.parse_args(argv)
    if args.quick:
        args.models, args.real_types, args.repeat, args.mixed_repeat = "smollm2", "q4_1_file,q4_k_m", 1, 1
    formats = args.formats.split(",")
    if "f32" not in formats or any(f not in FORMATS for f in formats):
        raise SystemExit(f"--formats: a comma-separated subset of {','.join(FORMATS)} that includes f32 "
                         "(the reference)")
    engines = args.engines.split(",")
    torch.set_num_threads(args.threads)
    why_not = llamacpp_missing() if "llamacpp" in engines else "not asked for (--engines)"
    out = result_path("quantized", args.out)
    rows: list[dict[str, Any]] = []
    acc: dict[str, dict[str, Any]] = {}
    result = {"date": str(date.today()), "threads": args.threads, "formats": formats,
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores", "note": args.note,
              "load": os.getloadavg()[0], "python": sys.version.split()[0], "torch": torch.__version__,
              "llamacpp": why_not or f"llama-cpp-python {os.environ.get('LLAMA_CPP_PYTHON', '0.3.36')} sdist build",
              "pagedecode_source": "the same GGUF file" if why_not is None else "the HF folder, quantization=",
              "kv_cache": {"pagedecode": f"{args.kv_cache_dtype} (bf16: bfloat16)", "llamacpp": "f16 (its default)"},
              "accuracy": acc, "results": rows}
    names = args.models.split(",")
    if "smollm2" in names:
        if why_not:
            raise SystemExit(f"--models smollm2 compares with llama.cpp: {why_not}")
        real_model(args, rows, out, result)
        names.remove("smollm2")
    models = evh.model_dirs(argparse.Namespace(model=None, models=",".join(names), stories=args.stories)) \
        if names else []
    workloads = args.workloads.split(",")
    bar = evh.progress(len(models) * (1 + len(workloads) * len(formats)), "quantized.py", unit="step")
    for mname, path in models:
        cfg = json.loads((path / "config.json").read_text())
        files = gguf_files(path, formats) if why_not is None else None
        sources = {fmt: source(files, path, fmt, args.kv_cache_dtype) for fmt in formats}
        loaded = {fmt: pd.Engine.from_pretrained(s["path"], dtype=s["dtype"], quantization=s["quantization"],
                                                 kv_cache_dtype=s["kv_cache_dtype"]) for fmt, s in sources.items()}
        reference = pd.Engine.from_pretrained(sources["f32"]["path"], dtype="float32")
        acc[mname] = accuracy(loaded, reference, prompts(args.prompts, cfg["vocab_size"]), args.accuracy_tokens,
                              files, args.threads)
        reference.close()
        for fmt in formats:
            a = acc[mname][fmt]
            llama = f"  vs llama.cpp {a['greedy_vs_llamacpp']['token_agreement']:.3f}" if files else ""
            print(f"{mname:<12} {fmt:<5} {a['weight_bytes'] / 1e6:8.2f} MB  max|dlogit| {a['max_abs_logit_diff']:.4f}"
                  f"  KL {a['mean_kl']:.3g}  greedy vs f32 {a['greedy_vs_f32']['token_agreement']:.3f}{llama}",
                  file=sys.stderr, flush=True)
        for e in loaded.values():
            e.close()
        del loaded
        bar.update(1)
        for wname in workloads:
            reqs = evh.workload(wname, cfg["vocab_size"], cfg.get("max_position_embeddings", 2048))
            useful = sum(o for _, o in reqs)
            repeat = args.repeat if wname == "single" else args.mixed_repeat
            own_f32 = None
            for fmt in formats:
                row: dict[str, Any] = {"model": mname, "workload": wname, "format": fmt, "requests": len(reqs),
                                       "useful_tokens": useful, "weight_bytes": acc[mname][fmt]["weight_bytes"]}
                names = [n for n in ("pagedecode", "llamacpp") if n in engines and (n != "llamacpp" or files)]
                if "transformers" in engines and fmt in ("f32", "bf16") and wname in args.hf_workloads.split(","):
                    names.append("transformers")
                got = speed(names, sources[fmt], files, fmt, reqs, args, path, wname, repeat)
                for name, r in got.items():
                    row[name] = {k: v for k, v in r.items() if k not in ("tokens", "load")}
                    row[name]["seconds"] = round(r["seconds"], 3)
                    row[name]["tok_s"] = round(useful / r["seconds"], 1)
                if "pagedecode" in got and "llamacpp" in got:
                    row["pagedecode_vs_llamacpp"] = round(got["llamacpp"]["seconds"] / got["pagedecode"]["seconds"], 2)
                if wname == "mixed" and fmt == "f32" and "llamacpp" in got:
                    floor = matmul_floor(cfg, reqs, args.threads)
                    floor["ceiling_vs_llamacpp"] = round(got["llamacpp"]["seconds"] / floor["floor_seconds"], 2)
                    row["f32_matmul_floor"] = floor
                    print(f"{mname:<12} mixed f32: {floor['matmul_gflop']} GFLOP of matmuls at the fastest GEMM "
                          f"here ({floor['gemm_gflops']} GFLOP/s) take >= {floor['floor_seconds']} s: at most "
                          f"{floor['ceiling_vs_llamacpp']}x llama.cpp", file=sys.stderr, flush=True)
                if "pagedecode" in got and "transformers" in got:
                    row["pagedecode_vs_transformers"] = round(got["transformers"]["seconds"]
                                                              / got["pagedecode"]["seconds"], 2)
                if "pagedecode" in got:
                    if fmt == "f32":
                        own_f32 = got["pagedecode"]["seconds"]
                    elif own_f32 is not None:
                        row["pagedecode_vs_own_f32"] = round(own_f32 / got["pagedecode"]["seconds"], 2)
                rows.append(row)
                line = "  ".join(f"{n} {row[n]['tok_s']:>8.1f}" for n in got)
                ratio = f"  {row['pagedecode_vs_llamacpp']}x llama.cpp" if "pagedecode_vs_llamacpp" in row else ""
                print(f"{mname:<12} {wname:<7} {fmt:<5} tok/s: {line}{ratio}", file=sys.stderr, flush=True)
                write_json(out, result)                 # as it goes: a cut-off run keeps its rows
                bar.update(1)
    bar.close()
    result["goals"] = goals(rows)
    result["load_end"] = os.getloadavg()
    write_json(out, result)
    plot(out, lambda axes: draw(axes, rows, result), size=(13, 4.5), ncols=2)
    print(f"wrote {out} (+ .png)")
    return 0


def matmul_floor(cfg: dict[str, Any], reqs: list, threads: int) -> dict[str, Any]:
    """The least time any float32 engine can spend on a workload's matmuls on this machine: its
    multiply-adds (every prompt and output token through every layer's weights, the LM head once
    per output token) at the fastest float32 GEMM rate measured here -- the best of torch's (MKL)
    and oneDNN's packed linear on the model's own weight shapes at 512 rows, --threads threads.
    Attention, norms and the runtime come on top: a real run is slower."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    dim = cfg.get("head_dim") or h // heads
    kv = cfg.get("num_key_value_heads", heads) * dim
    shapes = [(heads * dim + 2 * kv, h), (h, heads * dim), (2 * inter, h), (h, inter)]
    per_token = layers * sum(n * k for n, k in shapes)
    flops = 2 * sum(per_token * (len(p) + o) + cfg["vocab_size"] * h * o for p, o in reqs)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    rates = {"torch.mm": [], "onednn": []}
    try:
        for n, k in shapes:
            x, w = torch.randn(512, k), torch.randn(n, k)
            calls = {"torch.mm": lambda: torch.mm(x, w.t())}
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(w, 512)
                calls["onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
                calls["onednn"]()
            except (RuntimeError, AttributeError):
                pass
            for name, call in calls.items():
                best = float("inf")
                for _ in range(5):
                    call()
                    t0 = time.perf_counter()
                    for _ in range(10):
                        call()
                    best = min(best, (time.perf_counter() - t0) / 10)
                rates[name].append(2 * 512 * n * k / best)
    finally:
        torch.set_num_threads(before)
    # each library's rate over the four shapes weighted as a token uses them (time = sum flops / rate)
    layer = sum(n * k for n, k in shapes)
    per_lib = {name: layer / sum(n * k / r for (n, k), r in zip(shapes, rs)) for name, rs in rates.items() if rs}
    best_lib = max(per_lib, key=per_lib.get)
    return {"matmul_gflop": round(flops / 1e9, 1), "gemm_gflops": {k: round(v / 1e9, 1) for k, v in per_lib.items()},
            "floor_seconds": round(flops / per_lib[best_lib], 2), "fastest": best_lib}


def goals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 24's targets on the 135M-shaped model and issue 35's on the real one, read off the rows
    (those that were measured)."""
    out = []
    for r in rows:
        if r["model"] == "smollm2":
            bound = 1.0 if r["workload"] == "single" else 1.5
            out.append({"goal": f"smollm2 {r['workload']} {r['format']} >= {bound}x llama.cpp",
                        "value": r["pagedecode_vs_llamacpp"], "met": r["pagedecode_vs_llamacpp"] >= bound})
            continue
        if r["model"] != "llama135m" or "pagedecode_vs_llamacpp" not in r:
            continue
        if r["workload"] == "single" and r["format"] in ("q8_0", "q4_0"):
            out.append({"goal": f"single {r['format']} >= 1.0x llama.cpp", "value": r["pagedecode_vs_llamacpp"],
                        "met": r["pagedecode_vs_llamacpp"] >= 1.0})
        if r["workload"] == "single" and r["format"] == "q8_0" and "pagedecode_vs_own_f32" in r:
            out.append({"goal": "single q8_0 >= 1.6x pagedecode f32", "value": r["pagedecode_vs_own_f32"],
                        "met": r["pagedecode_vs_own_f32"] >= 1.6})
        if r["workload"] == "mixed":
            out.append({"goal": f"mixed {r['format']} >= 1.5x llama.cpp", "value": r["pagedecode_vs_llamacpp"],
                        "met": r["pagedecode_vs_llamacpp"] >= 1.5})
            if "f32_matmul_floor" in r:     # what float32 arithmetic allows on this machine at all
                out[-1]["ceiling"] = r["f32_matmul_floor"]["ceiling_vs_llamacpp"]
    return out


def draw(axes: Any, rows: list[dict[str, Any]], result: dict[str, Any]) -> None:
    left, right = axes
    names = [n for n in ("pagedecode", "llamacpp", "transformers") if any(n in r for r in rows)]
    width = 0.8 / max(1, len(names))
    for k, name in enumerate(names):
        xs = [i + k * width for i, r in enumerate(rows) if name in r]
        left.bar(xs, [r[name]["tok_s"] for r in rows if name in r], width, label=name)
    left.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))])
    left.set_xticklabels([f"{r['model'][:9]}\n{r['workload']}\n{r['format']}" for r in rows], fontsize=7)
    left.set_yscale("log")
    left.set_ylabel("useful tokens/s (log)")
    left.set_title(f"CPU, {result['threads']} threads, {result['date']}")
    left.legend()
    for mname, per in result["accuracy"].items():     # (the real model's accuracy: llamacpp_accuracy.py)
        fmts = [f for f in per if f != "f32"]
        right.plot(fmts, [max(per[f]["mean_kl"], 1e-9) for f in fmts], "o-", label=f"{mname} mean KL")
        right.plot(fmts, [max(per[f]["max_abs_logit_diff"], 1e-9) for f in fmts], "s--",
                   label=f"{mname} max |logit diff|")
    right.set_yscale("log")
    right.set_title("pagedecode vs its float32 logits (teacher-forced)")
    if result["accuracy"]:                             # (--models smollm2 alone has none to draw)
        right.legend(fontsize=7)


if __name__ == "__main__":
    sys.exit(main())
