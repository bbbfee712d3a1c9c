"""Per-token cost of constrained decoding (xgrammar) against the same unconstrained workload, in
one run, at the vocabulary sizes of the checkpoints at hand; plus grammar compile times.

    .venv/bin/python benchmarks/structured.py [--requests 16] [--max-tokens 64] [--out FILE]

Models: stories260k ($PAGEDECODE_STORIES, vocab 512) and the built-in default model (vocab 512),
and a 2-layer random Llama with vocab 32,000 written under benchmarks/.cache (the stories
tokenizer, ids past 512 padded), so the mask cost is seen at a realistic vocabulary.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import time
from datetime import date
from pathlib import Path

import pagedecode as pd
from common import plot, result_path, write_json

ROOT = Path(__file__).resolve().parent
REGEX = "[a-z ,.]{%d}"
SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 400, "maxLength": 400}},
          "required": ["story"]}


def wide_vocab_model(stories: Path) -> Path:
    import torch
    import transformers
    path = ROOT / ".cache" / "llama-v32000"
    if not (path / "model.safetensors").is_file():
        cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                       bos_token_id=1, eos_token_id=2)
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(stories / f, path / f)
    return path


def timed(eng: pd.Engine, params: list[pd.SamplingParams]) -> tuple[float, int]:
    t = time.perf_counter()
    outs = eng.generate(["Once upon a time"] * len(params), params)
    return time.perf_counter() - t, sum(o.usage.selected_tokens for o in outs)


def measure(name: str, path: Path, args: argparse.Namespace) -> dict:
    eng = pd.Engine.from_pretrained(path, max_batch_size=args.requests)
    n = args.max_tokens
    plain = [pd.SamplingParams(max_tokens=n, ignore_eos=True, seed=i) for i in range(args.requests)]   # greedy: the mask is the difference
    so = pd.StructuredOutput(regex=REGEX % n)
    constrained = [pd.SamplingParams(max_tokens=n, seed=i, structured_output=so)
                   for i in range(args.requests)]
    timed(eng, plain[:2])
    t0 = time.perf_counter()
    eng.generate("x", pd.SamplingParams(max_tokens=1, structured_output=so))      # compile (cached after)
    regex_compile = time.perf_counter() - t0
    t0 = time.perf_counter()
    eng.generate("x", pd.SamplingParams(max_tokens=1, structured_output=pd.StructuredOutput(json_schema=SCHEMA)))
    schema_compile = time.perf_counter() - t0
    rounds = []
    for _ in range(args.rounds):
        a = timed(eng, plain)
        b = timed(eng, constrained)
        rounds.append((a, b))
    base = min(r[0][0] / r[0][1] for r in rounds)
    cons = min(r[1][0] / r[1][1] for r in rounds)
    out = {"model": name, "vocab": eng.vocab_size, "requests": args.requests, "tokens_per_request": n,
           "unconstrained_us_per_token": 1e6 * base, "constrained_us_per_token": 1e6 * cons,
           "overhead_us_per_token": 1e6 * (cons - base), "ratio": cons / base,
           "regex_first_request_s": regex_compile, "json_schema_first_request_s": schema_compile,
           "compile_s": list(eng.constraints.compiler.compile_s)}
    print(f"{name:>12} vocab {out['vocab']:>6}: {out['unconstrained_us_per_token']:.1f} -> "
          f"{out['constrained_us_per_token']:.1f} us/token (+{out['overhead_us_per_token']:.1f}), "
          f"compiles {', '.join(f'{c * 1000:.0f} ms' for c in out['compile_s'])}", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    stories = os.environ.get("PAGEDECODE_STORIES")
    from pagedecode.model.default_model import default_model_path
    models = [("default", default_model_path())]
    if stories:
        models = [("stories260k", Path(stories)), *models, ("llama-v32000", wide_vocab_model(Path(stories)))]
    else:
        print("PAGEDECODE_STORIES is not set: only the default model is measured", file=sys.stderr)
    rows = [measure(name, path, args) for name, path in models]
    result = {"date": date.today().isoformat(), "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "rows": rows}
    out = result_path("structured", args.out)
    write_json(out, result)

    def draw(ax):
        names = [f"{r['model']}\n(vocab {r['vocab']})" for r in rows]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["unconstrained_us_per_token"] for r in rows], 0.4, label="unconstrained")
        ax.bar([i + 0.2 for i in x], [r["constrained_us_per_token"] for r in rows], 0.4, label="regex-constrained")
        ax.set_xticks(list(x), names)
        ax.set_ylabel("µs per token (batch of %d)" % args.requests)
        ax.legend()
    plot(out, draw, size=(7, 4))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
