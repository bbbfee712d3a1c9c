"""pagedecode vs transformers' generate, same checkpoint and workload, in one run.

Workloads
  single  one request: 64-token prompt, 128 new tokens
  mixed   64 requests, prompt lengths 16-512 and output lengths 16-256 (seeded); transformers
          runs them in padded batches (sorted by prompt length, --hf-batch at a time) and only
          the tokens each request asked for are counted as useful
Models
  stories260k  ../shared/models/stories260k (real weights)
  llama135m    a random Llama of SmolLM-135M's shape (hidden 576, 30 layers, 9 / 3 heads,
               vocab 49152), written by transformers on first use under benchmarks/.cache

Both sides run greedy with EOS ignored, float32 (the single workload: median of 5 runs), on the CPU threads torch is given. The
script checks that both produced the same tokens and prints tokens/s and the ratio; the
JSON goes to benchmarks/results/.
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import shutil
import sys
import time
from datetime import date
from pathlib import Path

import torch

import pagedecode as pd

ROOT = Path(__file__).resolve().parent
SHARED = ROOT.parent.parent / "shared"


def model_dir(name: str) -> Path:
    if name == "stories260k":
        return SHARED / "models" / "stories260k"
    path = ROOT / ".cache" / "llama135m"
    if not (path / "model.safetensors").is_file():
        import transformers
        cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                       num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                       max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                       bos_token_id=1, eos_token_id=2, initializer_range=0.06)
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
        for f in ("tokenizer.json", "tokenizer_config.json"):      # prompts are ids; any tokenizer loads
            shutil.copy(SHARED / "models" / "stories260k" / f, path / f)
    return path


def workload(name: str, vocab: int, context: int, seed: int = 0):
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


def run_pagedecode(path, reqs):
    total = sum(len(p) + o for p, o in reqs)
    engine = pd.Engine.from_pretrained(path, max_batch_size=64, max_cache_tokens=total + 64 * 16,
                                       max_tokens_per_step=2048)
    engine.generate([reqs[0][0][:8]], pd.SamplingParams(max_tokens=4, ignore_eos=True))        # warm-up
    params = [pd.SamplingParams(max_tokens=o, ignore_eos=True) for _, o in reqs]
    t0 = time.perf_counter()
    outs = engine.generate([p for p, _ in reqs], params)
    return time.perf_counter() - t0, [o.selected_token_ids for o in outs]


def run_transformers(path, reqs, batch):
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    order = sorted(range(len(reqs)), key=lambda i: len(reqs[i][0]))
    tokens = [None] * len(reqs)
    with torch.inference_mode():
        model.generate(torch.tensor([reqs[0][0][:8]]), max_new_tokens=4, do_sample=False, eos_token_id=None)
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
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            for row, i in enumerate(group):
                tokens[i] = out[row, width:width + reqs[i][1]].tolist()
        return time.perf_counter() - t0, tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="stories260k,llama135m")
    ap.add_argument("--workloads", default="single,mixed")
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--out", default=str(ROOT / "results" / f"engine_vs_hf-{date.today()}.json"))
    args = ap.parse_args(argv)
    rows = []
    for mname in args.models.split(","):
        path = model_dir(mname)
        cfg = json.loads((path / "config.json").read_text())
        for wname in args.workloads.split(","):
            reqs = workload(wname, cfg["vocab_size"], cfg["max_position_embeddings"])
            useful = sum(o for _, o in reqs)
            repeat = 5 if wname == "single" else 1          # short runs: the median of five
            pd_runs = [run_pagedecode(path, reqs) for _ in range(repeat)]
            hf_runs = [run_transformers(path, reqs, args.hf_batch if wname == "mixed" else 1) for _ in range(repeat)]
            pd_s, pd_tokens = sorted(pd_runs, key=lambda r: r[0])[repeat // 2]
            hf_s, hf_tokens = sorted(hf_runs, key=lambda r: r[0])[repeat // 2]
            same = sum(a == b for a, b in zip(pd_tokens, hf_tokens))
            row = {"model": mname, "workload": wname, "requests": len(reqs), "useful_tokens": useful,
                   "pagedecode_s": round(pd_s, 3), "transformers_s": round(hf_s, 3),
                   "pagedecode_tok_s": round(useful / pd_s, 1), "transformers_tok_s": round(useful / hf_s, 1),
                   "ratio": round(hf_s / pd_s, 2), "identical_requests": f"{same}/{len(reqs)}",
                   "hf_batch": args.hf_batch if wname == "mixed" else 1}
            rows.append(row)
            print(f"{mname:<12} {wname:<7} pagedecode {row['pagedecode_tok_s']:>9.1f} tok/s   "
                  f"transformers {row['transformers_tok_s']:>9.1f} tok/s   ratio {row['ratio']:>5.2f}x   "
                  f"identical {row['identical_requests']}", flush=True)
    result = {"date": str(date.today()), "machine": f"{platform.processor() or platform.machine()}, "
              f"{torch.get_num_threads()} torch threads", "python": sys.version.split()[0],
              "torch": torch.__version__, "results": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
