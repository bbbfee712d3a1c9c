"""Tensor parallelism: tokens/s and per-step collective time at N = 1 vs N = 2, same workload,
one run (CPU here with gloo; on a machine with >= 2 GPUs pass --device cuda for NCCL).

    .venv/bin/python benchmarks/tp.py [--model DIR] [--requests 8] [--max-tokens 32] [--device cpu]

Default model: a random Llama of about 135M parameters written under benchmarks/.cache
(hidden 576, 30 layers, 8 heads / 4 KV heads so that 2 ranks divide it: SmolLM-135M's own 9 / 3
heads do not; vocab 49152). On 2 CPU cores TP is not expected to be faster: both ranks share
the same cores and each step adds 2 all_reduces per layer.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from datetime import date
from pathlib import Path

from common import plot, result_path, write_json

ROOT = Path(__file__).resolve().parent


def model_135m() -> Path:
    path = ROOT / ".cache" / "llama135m-8heads"
    if not (path / "model.safetensors").is_file():
        import shutil

        import torch
        import transformers
        cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                       num_attention_heads=8, num_key_value_heads=4, head_dim=72,
                                       max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                                       tie_word_embeddings=True)
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
        stories = os.environ.get("PAGEDECODE_STORIES")
        if not stories:
            raise SystemExit("set PAGEDECODE_STORIES to the stories260k folder (its tokenizer is reused)")
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(stories) / f, path / f)
    return path


def run(path: Path, n: int, args: argparse.Namespace) -> dict:
    import pagedecode as pd
    eng = pd.Engine.from_pretrained(path, device=args.device, tensor_parallel_size=n, max_batch_size=args.requests)
    params = pd.SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [[1] + [3 + (7 * i + j) % 500 for j in range(31)] for i in range(args.requests)]
    eng.generate(prompts[:1], pd.SamplingParams(max_tokens=2))
    shard = getattr(eng.model, "shard", None)
    if shard is not None:
        shard.comm_s = 0.0
    steps0 = eng.snapshot().steps
    t = time.perf_counter()
    outs = eng.generate(prompts, params)
    wall = time.perf_counter() - t
    steps = eng.snapshot().steps - steps0           # step_records stop at 4,096 (none with trace="off")
    result = {"tensor_parallel_size": n, "wall_s": wall,
              "tokens_per_s": sum(o.usage.returned_tokens for o in outs) / wall, "steps": steps,
              "step_ms": 1000 * wall / max(steps, 1),
              "collective_ms_per_step": 1000 * (shard.comm_s if shard is not None else 0.0) / max(steps, 1),
              "tokens": [o.selected_token_ids for o in outs]}
    eng.close()
    print(f"N={n}: {result['tokens_per_s']:.1f} tok/s, {result['step_ms']:.1f} ms/step, "
          f"collectives {result['collective_ms_per_step']:.2f} ms/step", file=sys.stderr)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    path = Path(args.model) if args.model else model_135m()
    one, two = run(path, 1, args), run(path, 2, args)
    same = one.pop("tokens") == two.pop("tokens")
    result = {"date": date.today().isoformat(), "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "device": args.device, "model": str(path), "requests": args.requests,
              "max_tokens": args.max_tokens, "n1": one, "n2": two, "same_tokens": same,
              "ratio_n2_over_n1": two["tokens_per_s"] / one["tokens_per_s"]}
    print(f"N=2 / N=1 tokens/s: {result['ratio_n2_over_n1']:.2f}, same tokens: {same}")
    out = result_path("tp", args.out)
    write_json(out, result)

    def draw(ax):
        ax.bar(["N=1", "N=2"], [one["step_ms"], two["step_ms"]], label="step")
        ax.bar(["N=1", "N=2"], [one["collective_ms_per_step"], two["collective_ms_per_step"]], label="collectives")
        ax.set_ylabel("ms per step")
        ax.legend()
    plot(out, draw, size=(6, 4))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
