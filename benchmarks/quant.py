"""Single-stream decode with quantized weights: float32 vs Q8_0 / Q4_0 (int8 kernel, and the
dequantizing torch reference for Q8_0), tokens/s and engine.weight_bytes.

    python benchmarks/quant.py --stories DIR            # stories260k and a random 135M-shaped Llama

The 135M model is benchmarks/tp.py's (written under benchmarks/.cache on first use; its
embedding and tied LM head stay float32 under quantization=, as pagedecode keeps them).
Rounds are interleaved and the best of each is kept (the machine is shared).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from common import result_path, write_json

VARIANTS = [("float32", None, "auto"), ("q8_0", "q8_0", "auto"), ("q4_0", "q4_0", "auto"),
            ("q8_0 dequantizing reference", "q8_0", "torch")]


def decode_tokens_per_s(engine, tokens: int) -> float:
    import pagedecode as pd
    params = pd.SamplingParams(max_tokens=tokens, ignore_eos=True)
    engine.generate([[1, 403, 407]], pd.SamplingParams(max_tokens=2))
    t = time.perf_counter()
    out = engine.generate([[1, 403, 407]], params)[0]
    return len(out.token_ids) / (time.perf_counter() - t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stories", default=os.environ.get("PAGEDECODE_STORIES"))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-135m", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args(argv)
    import torch

    import pagedecode as pd
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.stories:
        raise SystemExit("--stories DIR (or PAGEDECODE_STORIES) names the stories260k folder")
    os.environ["PAGEDECODE_STORIES"] = args.stories
    models = {"stories260k": Path(args.stories)}
    if not args.skip_135m:
        from tp import model_135m
        models["llama135m"] = model_135m()
    results = {}
    for name, path in models.items():
        engines = {label: pd.Engine.from_pretrained(path, quantization=q, attention_backend=backend)
                   for label, q, backend in VARIANTS}
        best = {label: 0.0 for label in engines}
        for _ in range(args.rounds):
            for label, engine in engines.items():
                n = args.tokens if "reference" not in label or name == "stories260k" else max(8, args.tokens // 8)
                best[label] = max(best[label], decode_tokens_per_s(engine, n))
        results[name] = {label: {"tokens_per_s": best[label], "weight_bytes": engines[label].weight_bytes}
                         for label in engines}
        for label, r in results[name].items():
            print(f"{name:12s} {label:30s} {r['tokens_per_s']:8.1f} tok/s  {r['weight_bytes'] / 1e6:9.2f} MB",
                  file=sys.stderr)
    write_json(result_path("quant", None), {"tokens": args.tokens, "rounds": args.rounds,
                                            "threads": torch.get_num_threads(), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
