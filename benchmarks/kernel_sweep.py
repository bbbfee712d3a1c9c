"""Kernel benchmarks on a CUDA GPU: each kernel checked against its reference first, then timed
with triton.testing.do_bench (median), inputs rotated across copies so they exceed the L2,
beside a torch baseline, against the copy bandwidth measured in the same run.

    python3 benchmarks/kernel_sweep.py [--out FILE.json] [--sweep] [--quant] [--sanitize KERNEL]

--quant times the Q8_0 / Q4_0 matmuls instead, on an 8B model's up projection 14336 x 4096 with
bf16 activations: the GEMV at 1 row, the GEMM at 4 and 16, dequantize + matmul at 1,024 and 4,096
(past GEMM_MAX_ROWS; the sweep times the GEMM at 4,096): weight bytes / time against the copy
bandwidth, beside the torch path they replace (dequantize, then matmul) and a dense bf16 matmul;
then a row each for the other GGUF types (Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K: kernels/gguf_matmul.py)
at 1 row (the GEMV) and 16 (the GEMM), beside their torch path; and the segmented LoRA delta
(kernels/lora.py, rank 64, 16 rows over 4 adapters) beside its torch reference.
--sanitize KERNEL runs one small launch of one kernel (kv_write, decode, extend, sampling, quant,
lora, deterministic), for compute-sanitizer. Goals (bf16, 32 q / 8 kv heads, d128, page 16) are printed
beside results.

The default run also times deterministic mode's kernels (issue 22) beside what they replace:
kernels/matmul.py against torch's matmul (cuBLAS) on an 8B model's gate+up projection (28672 x 4096)
at 1, 64 and 4096 rows and its LM head (128256 x 4096) at 64 rows, each with "row_invariant" (row i
of the M-row product equals the same row computed alone, bitwise, on this GPU); the one-row-per-program
RMSNorm against torch's; deterministic extend attention (each token through the decode kernel) against
the default extend kernel on a prefill of 4096, a 512-token chunk after 3584 cached and 64 verifications
of 4 tokens at 2048, each with "same_bits_as_decode" (its rows equal the decode kernel's, bitwise).
"""
from __future__ import annotations

import argparse
import json
import sys
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedecode.kernels.decode_attention import (SPLIT_TOKENS, paged_decode_attention,  # noqa: E402
                                                 paged_decode_attention_triton, sm_count, split_tokens_for)
from pagedecode.kernels.extend_attention import paged_extend_attention, paged_extend_attention_triton  # noqa: E402
from pagedecode.kernels import gguf_matmul, quant_types  # noqa: E402
from pagedecode.kernels.kv_write import write_kv  # noqa: E402
from pagedecode.kernels.lora import lora_delta, lora_delta_reference  # noqa: E402
from pagedecode.kernels.matmul import deterministic_linear  # noqa: E402
from pagedecode.kernels.rmsnorm import rms_norm, rms_norm_deterministic  # noqa: E402
from pagedecode.kernels.quant_matmul import (GEMM_MAX_ROWS, GEMV_MAX_ROWS, dequantize_blocks,  # noqa: E402
                                             quant_gemm_triton, quant_gemv_triton, quant_matmul, quant_matmul_ref,
                                             random_blocks)
from pagedecode.kernels.sampling import make_sampling_inputs, sample, sample_ref  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16
DT = torch.bfloat16
COPIES = 4


def bench(fn):
    import triton
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3   # us


def copy_bandwidth() -> float:
    x = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    us = bench(lambda: y.copy_(x))
    return 2 * x.numel() * 2 / (us * 1e-6) / 1e9     # GB/s, read + write


def paged_setup(batch, ctx, copies=COPIES):
    """One pool holding `copies` disjoint sets of pages; a page table per copy (random order)."""
    pages_per = -(-ctx // PAGE)
    n_pages = batch * pages_per * copies
    kc = torch.randn(n_pages, PAGE, HKV, D, dtype=DT, device="cuda")
    vc = torch.randn_like(kc)
    perm = torch.randperm(n_pages, device="cuda").to(torch.int32)
    tables = [perm[c * batch * pages_per:(c + 1) * batch * pages_per].view(batch, pages_per) for c in range(copies)]
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return kc, vc, tables, lens


def torch_decode(q, kc, vc, table, lens):
    """Baseline: gather each sequence's pages, then scaled_dot_product_attention."""
    B, ctx = table.shape[0], int(lens[0])
    k = kc[table.long()].view(B, -1, HKV, D)[:, :ctx].transpose(1, 2)
    v = vc[table.long()].view(B, -1, HKV, D)[:, :ctx].transpose(1, 2)
    return torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]


def decode_case(batch, ctx, bw, goal_us, deterministic=False):
    """Split-KV decode: the heuristic's split length (split_tokens_for) or, deterministic, the
    fixed SPLIT_TOKENS; rows say which."""
    kc, vc, tables, lens = paged_setup(batch, ctx)
    qs = [torch.randn(batch, HQ, D, dtype=DT, device="cuda") for _ in range(COPIES)]
    run = lambda q, t: paged_decode_attention(q, kc, vc, t, lens, deterministic=deterministic)  # noqa: E731
    out = run(qs[0], tables[0])
    ref = torch_decode(qs[0].float(), kc.float(), vc.float(), tables[0], lens)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    i = iter(range(10**9))
    ours = bench(lambda: run(qs[next(i) % COPIES], tables[next(i) % COPIES]))
    base = bench(lambda: torch_decode(qs[next(i) % COPIES], kc, vc, tables[next(i) % COPIES], lens))
    nbytes = 2 * batch * ctx * HKV * D * 2 + 2 * batch * HQ * D * 2
    gbs = nbytes / (ours * 1e-6) / 1e9
    split = SPLIT_TOKENS if deterministic else split_tokens_for(batch, HKV, ctx, sm_count(qs[0].device), 64)
    return {"kernel": f"decode B={batch} ctx={ctx}" + (" deterministic" if deterministic else ""),
            "us": round(ours, 1), "torch_us": round(base, 1),
            "speedup": round(base / ours, 2), "GB/s": round(gbs), "of_bandwidth": round(gbs / bw, 3),
            "goal_us": goal_us, "rel_err": err, "split_tokens": split, "splits": -(-ctx // split)}


def prefill_case(n, goal_tflops):
    kc, vc, tables, lens = paged_setup(1, n, copies=1)
    q = torch.randn(n, HQ, D, dtype=DT, device="cuda")
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    out = paged_extend_attention(q, kc, vc, tables[0], cu, lens)
    k = kc[tables[0].long()].view(-1, HKV, D)[:n].transpose(0, 1)
    v = vc[tables[0].long()].view(-1, HKV, D)[:n].transpose(0, 1)
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True,  # noqa: E731
                                                                     enable_gqa=True)
    ref = sdpa().transpose(0, 1).float()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    ours = bench(lambda: paged_extend_attention(q, kc, vc, tables[0], cu, lens, max_new=n))
    base = bench(sdpa)
    flops = 4 * n * n * HQ * D / 2                 # causal: half of QK^T and PV
    tf = flops / (ours * 1e-6) / 1e12
    return {"kernel": f"prefill causal n={n}", "us": round(ours, 1), "torch_us": round(base, 1),
            "speedup": round(base / ours, 2), "TFLOP/s": round(tf, 1), "goal_TFLOP/s": goal_tflops, "rel_err": err}


def det_matmul_case(m, n, k):
    """Deterministic matmul vs torch's F.linear (cuBLAS) at m rows of a (n, k) bf16 weight."""
    copies = max(1, -(-3 * L2_BYTES // (n * k * 2)))                  # weights rotated past the L2
    ws = [torch.randn(n, k, dtype=DT, device="cuda") * 0.02 for _ in range(copies)]
    xs = [torch.randn(m, k, dtype=DT, device="cuda") for _ in range(COPIES)]
    out = deterministic_linear(xs[0], ws[0])
    ref = xs[0].float() @ ws[0].float().t()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    rows = [0, m // 2, m - 1] if m > 1 else [0]
    invariant = all(torch.equal(deterministic_linear(xs[0][r:r + 1], ws[0])[0], out[r]) for r in rows)
    if m >= 3:
        invariant = invariant and torch.equal(deterministic_linear(xs[0][1:4], ws[0]), out[1:4])
    i = iter(range(10**9))
    ours = bench(lambda: deterministic_linear(xs[next(i) % COPIES], ws[next(i) % copies]))
    base = bench(lambda: torch.nn.functional.linear(xs[next(i) % COPIES], ws[next(i) % copies]))
    row = {"kernel": f"det matmul M={m} {n}x{k}", "us": round(ours, 1), "torch_us": round(base, 1),
           "speedup": round(base / ours, 2), "rel_err": err, "row_invariant": invariant}
    if m >= 64:
        row["TFLOP/s"] = round(2 * m * n * k / (ours * 1e-6) / 1e12, 1)
    else:
        row["of_bandwidth"] = round(n * k * 2 / (ours * 1e-6) / 1e9 / COPY_BW[0], 3)
    return row


def det_rmsnorm_case(m, h=4096):
    xs = [torch.randn(m, h, dtype=DT, device="cuda") for _ in range(COPIES)]
    w = torch.rand(h, dtype=DT, device="cuda") + 0.5
    out = rms_norm_deterministic(xs[0], w, 1e-5)
    err = ((out.float() - rms_norm(xs[0], w, 1e-5).float()).norm() / out.float().norm()).item()
    invariant = torch.equal(rms_norm_deterministic(xs[0][-1:], w, 1e-5)[0], out[-1])
    i = iter(range(10**9))
    ours = bench(lambda: rms_norm_deterministic(xs[next(i) % COPIES], w, 1e-5))
    base = bench(lambda: rms_norm(xs[next(i) % COPIES], w, 1e-5))
    return {"kernel": f"det rmsnorm M={m} H={h}", "us": round(ours, 1), "torch_us": round(base, 1),
            "speedup": round(base / ours, 2), "rel_err": err, "row_invariant": invariant}


def det_extend_case(seqs, prefix, new):
    """Deterministic extend (every token through the decode kernel) vs the default extend kernel:
    `seqs` sequences of `prefix` cached + `new` new tokens each."""
    ctx = prefix + new
    kc, vc, tables, _ = paged_setup(seqs, ctx, copies=1)
    table = tables[0]
    q = torch.randn(seqs * new, HQ, D, dtype=DT, device="cuda")
    cu = torch.arange(seqs + 1, dtype=torch.int32, device="cuda") * new
    lens = torch.full((seqs,), ctx, dtype=torch.int32, device="cuda")
    det = paged_extend_attention(q, kc, vc, table, cu, lens, max_new=new, deterministic=True)
    default = paged_extend_attention(q, kc, vc, table, cu, lens, max_new=new)
    err = ((det.float() - default.float()).norm() / default.float().norm()).item()
    last = torch.arange(seqs, device="cuda") * new + new - 1                 # each sequence's last token
    dec = paged_decode_attention(q[last], kc, vc, table, lens)
    mid = torch.arange(seqs, device="cuda") * new + new // 2                # and a middle one
    dec_mid = paged_decode_attention(q[mid], kc, vc, table, lens - (new - 1 - new // 2))
    same = torch.equal(dec, det[last]) and torch.equal(dec_mid, det[mid])
    ours = bench(lambda: paged_extend_attention(q, kc, vc, table, cu, lens, max_new=new, deterministic=True))
    base = bench(lambda: paged_extend_attention(q, kc, vc, table, cu, lens, max_new=new))
    tf = 4 * seqs * new * (prefix + (new + 1) / 2) * HQ * D / (ours * 1e-6) / 1e12
    return {"kernel": f"det extend {seqs}x(+{new} after {prefix})", "us": round(ours, 1), "default_us": round(base, 1),
            "speedup": round(base / ours, 2), "TFLOP/s": round(tf, 1), "rel_err_vs_default": err,
            "same_bits_as_decode": same}


COPY_BW = [0.0]                       # set by main: the copy bandwidth measured in this run


def torch_sort_sampler(logits, temperature, top_k, top_p):
    """Baseline: temperature, top-k, then top-p by sorting, then torch.multinomial."""
    z = logits / temperature[:, None]
    zs, idx = z.sort(dim=-1, descending=True)
    ranks = torch.arange(z.shape[1], device=z.device)[None, :]
    zs = zs.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = zs.softmax(-1)
    cum = probs.cumsum(-1)
    probs = probs.masked_fill(cum - probs > top_p[:, None], 0.0)
    choice = torch.multinomial(probs, 1)
    return idx.gather(1, choice)[:, 0]


SAMPLING_CASES = {      # name -> (temperature, top_k, top_p, min_p, goal us on H200 (issue 39))
    "T=0.8 k=50 p=0.9": (0.8, 50, 0.9, 0.0, 200),
    "greedy": (0.0, 0, 1.0, 0.0, 20),
    "T=1.0 min_p=0.05": (1.0, 0, 1.0, 0.05, 200),
    "T=0.8 p=0.9 (row path)": (0.8, 0, 0.9, 0.0, None),
}


def sampling_case(name):
    """64 rows x Llama 3's 128,256 tokens, each row its own seed (Philox stream): the tokens
    against the reference's, row 5's token alone against in the batch, then the time beside a
    torch sort + multinomial sampler."""
    temperature, top_k, top_p, min_p, goal_us = SAMPLING_CASES[name]
    B, V = 64, 128256
    logits = [torch.randn(B, V, device="cuda") * 4 for _ in range(COPIES)]
    inp = make_sampling_inputs([temperature] * B, [top_k] * B, [top_p] * B, [min_p] * B,
                               [1000003 * r for r in range(B)], [7] * B, device="cuda")
    got = sample(logits[0], inp).tokens
    want = sample_ref(logits[0], inp).tokens
    agree = (got == want).float().mean().item()
    one = make_sampling_inputs([temperature], [top_k], [top_p], [min_p], [1000003 * 5], [7], device="cuda")
    alone = sample(logits[0][5:6], one).tokens
    i = iter(range(10**9))
    ours = bench(lambda: sample(logits[next(i) % COPIES], inp))
    t, k, p = inp.temperature.clamp_min(1e-5), torch.where(inp.top_k > 0, inp.top_k, V).long(), inp.top_p
    base = bench(lambda: torch_sort_sampler(logits[next(i) % COPIES], t, k, p))
    return {"kernel": f"sampling 64x128256 {name}", "us": round(ours, 1), "torch_us": round(base, 1),
            "speedup": round(base / ours, 2), "goal_us": goal_us, "agrees_with_reference": agree,
            "same_token_alone": bool(alone.item() == got[5].item())}


def kv_write_case(bw, goal_us):
    T = 8192
    kc, vc, _, _ = paged_setup(64, 4096, copies=1)
    slots = [torch.randperm(kc.shape[0] * PAGE, device="cuda")[:T] for _ in range(COPIES)]
    ks = [torch.randn(T, HKV, D, dtype=DT, device="cuda") for _ in range(COPIES)]
    write_kv(kc, vc, ks[0], ks[1], slots[0])
    ok = torch.equal(kc.view(-1, HKV, D)[slots[0]], ks[0])
    i = iter(range(10**9))
    ours = bench(lambda: write_kv(kc, vc, ks[next(i) % COPIES], ks[next(i) % COPIES], slots[next(i) % COPIES]))
    base = bench(lambda: write_kv(kc, vc, ks[next(i) % COPIES], ks[next(i) % COPIES], slots[next(i) % COPIES],
                                  backend="torch"))
    nbytes = 2 * 2 * T * HKV * D * 2
    gbs = nbytes / (ours * 1e-6) / 1e9
    return {"kernel": f"kv write T={T}", "us": round(ours, 1), "torch_us": round(base, 1),
            "speedup": round(base / ours, 2), "GB/s": round(gbs), "of_bandwidth": round(gbs / bw, 3),
            "goal_us": goal_us, "correct": ok}


QUANT_N, QUANT_K = 14336, 4096         # an 8B Llama's up projection
L2_BYTES = 60 * 1024**2


def quant_setup(kind, n, k, rows):
    """Weight blocks rotated across enough copies that they exceed 3x the L2, activations (rows, k)."""
    nbytes = n * quant_types.row_bytes(kind, k)
    copies = max(COPIES, -(-3 * L2_BYTES // nbytes))
    blocks = random_blocks if kind in ("q8_0", "q4_0") else quant_types.random_blocks
    weights = [blocks(n, k, kind, device="cuda") for _ in range(copies)]
    xs = [torch.randn(rows, k, dtype=DT, device="cuda") for _ in range(copies)]
    return weights, xs, nbytes


def quant_case(kind, rows, n, k, bw, dense=True):
    """Our kernel (GEMV or GEMM by rows) against the path it replaces: dequantize, then matmul
    (and a dense bf16 matmul of the same shape, unless `dense` is False: it is the same for every type)."""
    weights, xs, nbytes = quant_setup(kind, n, k, rows)
    copies = len(weights)
    out = quant_matmul(xs[0], weights[0], kind)
    ref = xs[0].float() @ dequantize_blocks(weights[0], kind).t()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    i = iter(range(10**9))
    ours = bench(lambda: quant_matmul(xs[next(i) % copies], weights[next(i) % copies], kind))
    base = bench(lambda: quant_matmul_ref(xs[next(i) % copies], weights[next(i) % copies], kind))
    gbs = nbytes / (ours * 1e-6) / 1e9
    if kind in gguf_matmul.KINDS:
        gemv_max, gemm_max = gguf_matmul.GEMV_MAX_ROWS, gguf_matmul.GEMM_MAX_ROWS
    else:
        gemv_max, gemm_max = GEMV_MAX_ROWS, GEMM_MAX_ROWS
    path = "gemv" if rows <= gemv_max else "gemm" if rows <= gemm_max else "dequantize+mm"
    row = {"kernel": f"quant {path} {kind} M={rows} {n}x{k}", "us": round(ours, 1), "torch_us": round(base, 1),
           "speedup": round(base / ours, 2), "weight_MB": round(nbytes / 1e6, 1),
           "GB/s": round(gbs), "of_bandwidth": round(gbs / bw, 3), "rel_err": err}
    if dense:
        dense_ws = [dequantize_blocks(w, kind, DT) for w in weights[:max(COPIES, -(-3 * L2_BYTES // (n * k * 2)))]]
        row["dense_bf16_us"] = round(bench(lambda: torch.nn.functional.linear(xs[next(i) % copies],
                                                                              dense_ws[next(i) % len(dense_ws)])), 1)
    if rows > 16:
        row["TFLOP/s"] = round(2 * rows * n * k / (ours * 1e-6) / 1e12, 1)
    return row


def lora_case(rows=16, adapters=4, rank=64, n=QUANT_N, k=QUANT_K):
    """The segmented LoRA delta of one projection (the up projection's shape) for `rows` rows split
    evenly over `adapters` adapters, beside its torch reference: A and B bytes / time."""
    a = torch.randn(adapters, rank, k, dtype=DT, device="cuda") / k ** 0.5
    b = torch.randn(adapters, n, rank, dtype=DT, device="cuda") / rank ** 0.5
    scaling = torch.ones(adapters, device="cuda")
    x = torch.randn(rows, k, dtype=DT, device="cuda")
    starts = torch.arange(0, rows + 1, rows // adapters, dtype=torch.int32, device="cuda")
    slots = torch.arange(adapters, dtype=torch.int32, device="cuda")
    out = lora_delta(x, starts, slots, a, b, scaling)
    ref = lora_delta_reference(x, starts, slots, a, b, scaling).float()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    ours = bench(lambda: lora_delta(x, starts, slots, a, b, scaling))
    base = bench(lambda: lora_delta_reference(x, starts, slots, a, b, scaling))
    nbytes = (a.numel() + b.numel()) * 2
    return {"kernel": f"lora rank={rank} M={rows} over {adapters} {n}x{k}", "us": round(ours, 1),
            "torch_us": round(base, 1), "speedup": round(base / ours, 2), "GB/s": round(nbytes / (ours * 1e-6) / 1e9),
            "rel_err": err}


# (block_n, block_k, warps) for the GEMV, (block_m, block_n, block_k, warps, stages) for the GEMM;
# tests/kernels/compile_hopper.py compiles each for sm_90
QUANT_GEMV_CONFIGS = [dict(block_n=n, block_k=k, num_warps=w) for n, k, w in ((4, 256, 1), (16, 256, 4), (8, 1024, 4))]
QUANT_GEMM_CONFIGS = [dict(block_m=m, block_n=n, block_k=k, num_warps=w, num_stages=st) for m, n, k, w, st in
                      ((16, 32, 128, 4, 4), (32, 32, 128, 4, 4), (128, 128, 64, 8, 3), (16, 64, 128, 4, 3),
                       (64, 128, 64, 4, 4))]


def quant_sweep(bw, rows, save):
    """Each launch configuration of the quantized GEMV (1 row) and GEMM (16 and 4096 rows)."""
    for kind in ("q8_0", "q4_0"):
        for m, configs, launch in ((1, QUANT_GEMV_CONFIGS, quant_gemv_triton),
                                   (16, QUANT_GEMM_CONFIGS[:2] + QUANT_GEMM_CONFIGS[3:4], quant_gemm_triton),
                                   (4096, QUANT_GEMM_CONFIGS[2:3] + QUANT_GEMM_CONFIGS[4:], quant_gemm_triton)):
            weights, xs, nbytes = quant_setup(kind, QUANT_N, QUANT_K, m)
            out = torch.empty(m, QUANT_N, dtype=DT, device="cuda")
            for cfg in configs:
                name = f"quant {kind} M={m} {QUANT_N}x{QUANT_K}"
                i = iter(range(10**9))
                try:
                    us = bench(lambda: launch(xs[next(i) % len(xs)], weights[next(i) % len(weights)], kind, out, **cfg))
                    rows.append({"kernel": name, **cfg, "us": round(us, 1),
                                 "of_bandwidth": round(nbytes / (us * 1e-6) / 1e9 / bw, 3)})
                except Exception as e:
                    rows.append({"kernel": name, **cfg, "error": str(e)[:200]})
                print(json.dumps(rows[-1]), flush=True)
                save()
            del weights, xs
            torch.cuda.empty_cache()


DECODE_CONFIGS = [dict(block_n=n, num_warps=w, num_stages=st) for n, w, st in
                  ((32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 8, 2))]
PREFILL_CONFIGS = [dict(block_rows=m, block_n=n, num_warps=w, num_stages=st) for m, n, w, st in
                   ((64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 4, 3), (64, 32, 4, 3))]


def sweep(bw, rows, save):
    """Time each launch configuration of the two attention kernels on the goal shapes; the
    defaults in the wrappers should become the winners. Rows go to `rows`, save() after each."""
    for batch, ctx in ((64, 4096), (1, 32768)):
        kc, vc, tables, lens = paged_setup(batch, ctx)
        qs = [torch.randn(batch, HQ, D, dtype=DT, device="cuda") for _ in range(COPIES)]
        nbytes = 2 * batch * ctx * HKV * D * 2
        for cfg in DECODE_CONFIGS:
            i = iter(range(10**9))
            try:
                us = bench(lambda: paged_decode_attention_triton(qs[next(i) % COPIES], kc, vc, tables[next(i) % COPIES],
                                                                 lens, D ** -0.5, **cfg))
                rows.append({"kernel": f"decode B={batch} ctx={ctx}", **cfg, "us": round(us, 1),
                             "of_bandwidth": round(nbytes / (us * 1e-6) / 1e9 / bw, 3)})
            except Exception as e:
                rows.append({"kernel": f"decode B={batch} ctx={ctx}", **cfg, "error": str(e)[:200]})
            print(json.dumps(rows[-1]), flush=True)
            save()
        # split lengths around the heuristic's choice (split_tokens_for): is it the fastest?
        for split in (256, 512, 1024, 2048, 4096):
            i = iter(range(10**9))
            us = bench(lambda: paged_decode_attention_triton(qs[next(i) % COPIES], kc, vc, tables[next(i) % COPIES],
                                                             lens, D ** -0.5, split_tokens=split))
            rows.append({"kernel": f"decode B={batch} ctx={ctx}", "split_tokens": split, "us": round(us, 1),
                         "of_bandwidth": round(nbytes / (us * 1e-6) / 1e9 / bw, 3)})
            print(json.dumps(rows[-1]), flush=True)
            save()
        del kc, vc
        torch.cuda.empty_cache()
    n = 8192
    kc, vc, tables, lens = paged_setup(1, n, copies=1)
    q = torch.randn(n, HQ, D, dtype=DT, device="cuda")
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    for cfg in PREFILL_CONFIGS:
        try:
            us = bench(lambda: paged_extend_attention_triton(q, kc, vc, tables[0], cu, lens, D ** -0.5, max_new=n, **cfg))
            rows.append({"kernel": f"prefill n={n}", **cfg, "us": round(us, 1),
                         "TFLOP/s": round(4 * n * n * HQ * D / 2 / (us * 1e-6) / 1e12, 1)})
        except Exception as e:
            rows.append({"kernel": f"prefill n={n}", **cfg, "error": str(e)[:200]})
        print(json.dumps(rows[-1]), flush=True)
        save()


def sanitize(kernel):
    """One small launch, for compute-sanitizer."""
    kc, vc, tables, lens = paged_setup(3, 300, copies=1)
    if kernel == "kv_write":
        write_kv(kc, vc, torch.randn(5, HKV, D, dtype=DT, device="cuda"), torch.randn(5, HKV, D, dtype=DT,
                 device="cuda"), torch.tensor([0, 17, -1, 40, 99], device="cuda"))
    elif kernel == "decode":
        paged_decode_attention(torch.randn(3, HQ, D, dtype=DT, device="cuda"), kc, vc, tables[0], lens)
    elif kernel == "extend":
        cu = torch.tensor([0, 10, 11, 40], dtype=torch.int32, device="cuda")
        paged_extend_attention(torch.randn(40, HQ, D, dtype=DT, device="cuda"), kc, vc, tables[0], cu, lens)
    elif kernel == "quant":
        for kind in quant_types.KINDS:
            k = 288 if quant_types.BLOCK_TYPES[kind].block == 32 else 512
            blocks = quant_types.random_blocks(111, k, kind, device="cuda")
            for rows in (1, 17, 600):              # the GEMV, the GEMM, dequantize + matmul
                quant_matmul(torch.randn(rows, k, dtype=DT, device="cuda"), blocks, kind)
    elif kernel == "lora":
        a, b = torch.randn(3, 13, 288, dtype=DT, device="cuda"), torch.randn(3, 111, 13, dtype=DT, device="cuda")
        starts = torch.tensor([0, 3, 3, 20, 21], dtype=torch.int32, device="cuda")
        slots = torch.tensor([1, 2, -1, 0], dtype=torch.int32, device="cuda")
        lora_delta(torch.randn(21, 288, dtype=DT, device="cuda"), starts, slots, a, b, torch.ones(3, device="cuda"))
    elif kernel == "deterministic":
        w = torch.randn(111, 288, dtype=DT, device="cuda")
        for rows in (1, 70):
            deterministic_linear(torch.randn(rows, 288, dtype=DT, device="cuda"), w, w[:, 0].contiguous())
        rms_norm_deterministic(torch.randn(5, 288, dtype=DT, device="cuda"), w[0].contiguous(), 1e-5)
        cu = torch.tensor([0, 10, 11, 40], dtype=torch.int32, device="cuda")
        paged_extend_attention(torch.randn(40, HQ, D, dtype=DT, device="cuda"), kc, vc, tables[0], cu, lens,
                               deterministic=True)
    elif kernel == "sampling":
        inp = make_sampling_inputs([0.8, 0, 1], [5, 0, 0], [0.9, 1, 0.5], [0, 0, 0.1], [1, 2, 3], [0, 1, 2],
                                   device="cuda")
        sample(torch.randn(3, 1000, device="cuda"), inp)
    torch.cuda.synchronize()
    print(f"sanitize {kernel}: ran")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--sanitize", default=None)
    ap.add_argument("--sweep", action="store_true", help="also time the kernels' launch configs")
    ap.add_argument("--quant", action="store_true", help="the quantized matmuls instead of attention and sampling")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_sweep.py needs a CUDA GPU")
        return 2
    if args.sanitize:
        sanitize(args.sanitize)
        return 0
    torch.manual_seed(0)
    bw = copy_bandwidth()
    COPY_BW[0] = bw
    rows = [{"kernel": "device copy (read+write)", "GB/s": round(bw)}]
    result = {"date": str(date.today()), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "results": rows, "sweep": []}

    def save():                                    # after every row: a timeout keeps what was done
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    cases = [("decode B=64 ctx=4096", lambda: decode_case(64, 4096, bw, 312)),
             ("decode B=32 ctx=4096", lambda: decode_case(32, 4096, bw, 160)),
             ("decode B=1 ctx=32768", lambda: decode_case(1, 32768, bw, 40)),
             ("decode B=1 ctx=32768 deterministic", lambda: decode_case(1, 32768, bw, None, deterministic=True)),
             ("prefill causal n=8192", lambda: prefill_case(8192, 300))]
    cases += [(f"sampling 64x128256 {name}", lambda name=name: sampling_case(name)) for name in SAMPLING_CASES]
    cases += [("kv write T=8192", lambda: kv_write_case(bw, 22))]
    cases += [(f"det matmul M={m} {n}x{k}", lambda m=m, n=n, k=k: det_matmul_case(m, n, k))
              for m, n, k in ((1, 28672, 4096), (64, 28672, 4096), (4096, 28672, 4096), (64, 128256, 4096))]
    cases += [(f"det rmsnorm M={m}", lambda m=m: det_rmsnorm_case(m)) for m in (1, 4096)]
    cases += [(f"det extend {s}x(+{n} after {p})", lambda s=s, p=p, n=n: det_extend_case(s, p, n))
              for s, p, n in ((1, 0, 4096), (1, 3584, 512), (64, 2048, 4))]
    if args.quant:
        cases = [(f"quant {kind} M={m}", lambda kind=kind, m=m: quant_case(kind, m, QUANT_N, QUANT_K, bw))
                 for kind in ("q8_0", "q4_0") for m in (1, 4, 16, 1024, 4096)]
        cases += [(f"quant {kind} M={m}", lambda kind=kind, m=m: quant_case(kind, m, QUANT_N, QUANT_K, bw, dense=False))
                  for kind in gguf_matmul.KINDS for m in (1, 16)]
        cases += [("lora rank=64 M=16 over 4", lora_case)]
    for name, case in cases:
        try:
            rows.append(case())
        except Exception as e:                     # one failing case must not hide the others
            rows.append({"kernel": name, "error": f"{type(e).__name__}: {e}"[:500]})
        print(json.dumps(rows[-1]), flush=True)
        save()
        torch.cuda.empty_cache()
    if args.sweep:
        try:
            (quant_sweep if args.quant else sweep)(bw, result["sweep"], save)
        except Exception as e:
            result["sweep"].append({"kernel": "sweep", "error": f"{type(e).__name__}: {e}"[:500]})
            save()
    print()
    print(f"{'kernel':<40}{'us':>9}{'torch us':>10}{'x':>7}  fraction / rate")
    for r in rows[1:]:
        rate = r.get("of_bandwidth", r.get("TFLOP/s", r.get("agrees_with_reference", r.get("error", ""))))
        bits = {k: r[k] for k in ("row_invariant", "same_bits_as_decode", "same_token_alone", "splits")
                if k in r}   # deterministic rows, sampling's batch check, decode's splits
        base = r.get("torch_us", r.get("default_us", float("nan")))                    # det extend: the default
        print(f"{r['kernel']:<40}{r.get('us', float('nan')):>9}{base:>10}"
              f"{r.get('speedup', float('nan')):>7}  {rate}{'  ' + str(bits) if bits else ''}")
    print(f"copy bandwidth {bw:.0f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
