"""`make sanitize`: the compiled extension built with AddressSanitizer, its pooled kernels run
across thread counts with every input freed right after each call.

A worker of csrc/work_pool.h's pool whose chunk the caller took back may still be reading the
call's inputs after the call returned; the pool holds them (work::Keep) until no worker is inside
the call. Here nothing else holds them: each call's weights, activations, KV caches and tables are
fresh tensors dropped as soon as it returns, at 1-4 threads on however many cores there are (more
threads than cores: workers descheduled mid-chunk, chunks taken back). A late read of freed memory
is a heap-use-after-free report and a non-zero exit.

Run by the Makefile under LD_PRELOAD=libasan.so (Python itself is not instrumented); builds into
build/sanitize/ (a few minutes the first time), never touching pagedecode/_cpu*.so.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def build():
    from torch.utils.cpp_extension import load
    env_preload = os.environ.pop("LD_PRELOAD", None)   # the compiler runs uninstrumented
    out = ROOT / "build" / "sanitize"
    out.mkdir(parents=True, exist_ok=True)
    flags = ["-O1", "-g", "-std=c++17", "-fopenmp", "-fno-trapping-math", "-fno-math-errno", "-march=native",
             "-fsanitize=address", "-fno-omit-frame-pointer"]
    ext = load(name="_cpu_asan", sources=[str(ROOT / "csrc" / "cpu_forward.cpp")], extra_cflags=flags,
               extra_ldflags=["-fsanitize=address", "-fopenmp"], build_directory=str(out), verbose=False)
    if env_preload is not None:
        os.environ["LD_PRELOAD"] = env_preload
    return ext


def q8_blocks(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """A random Q8_0 weight (n, k) in GGUF's layout: per 32 inputs a float16 scale and 32 int8."""
    scale = torch.full((n, k // 32, 1), 0.01, dtype=torch.float16).view(torch.uint8)
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=g, dtype=torch.int8).view(torch.uint8)
    return torch.cat([scale, q], -1).reshape(n, -1).contiguous()


def pages(seqs: int, page: int, num_pages: int, g: torch.Generator):
    """A decode batch of `seqs` sequences of random lengths (one row each): page table, lengths,
    cu_q. Contexts of 256-511 positions: enough work that attention goes to the pool."""
    lens = torch.randint(256, 512, (seqs,), generator=g, dtype=torch.int32)
    width = int((lens.max() + page - 1) // page)
    table = torch.randperm(num_pages, generator=g)[:seqs * width].view(seqs, width).to(torch.int32)
    return table.contiguous(), lens, torch.arange(seqs + 1, dtype=torch.int32)


def matmuls(ext, g: torch.Generator, calls: int) -> None:
    for i in range(calls):
        rows = 1 + i % 7
        k, n = 512, 768
        blocks = q8_blocks(n, k, g)
        if i % 2:
            blocks = ext.quant_pack(blocks, k)          # the packed layout's kernel (quant_lanes.h)
        x = torch.randn(rows, k, generator=g)
        y = ext.quant_linear(x, blocks, n)
        del blocks, x                                   # freed while late workers may still run
        assert y.shape == (rows, n) and bool(torch.isfinite(y).all())


def attentions(ext, g: torch.Generator, calls: int) -> None:
    page, num_pages, hkv, d = 16, 256, 2, 64
    for i in range(calls):
        seqs = 1 + i % 7
        table, lens, cu = pages(seqs, page, num_pages, g)
        k = torch.randn(num_pages, page, hkv, d, generator=g)
        v = torch.randn(num_pages, page, hkv, d, generator=g)
        q = torch.randn(seqs, 8, d, generator=g)
        out = ext.det_attention(q, k, v, table, lens, cu, 0.125, pool=True)
        del k, v, q, table, lens, cu
        assert out.shape == (seqs, 8, d)


def forwards(ext, g: torch.Generator, calls: int) -> None:
    """The one-call forward of a quantized model (its matmuls and decode attention on the pool),
    the model and its cache built for one call and freed right after it."""
    H, Hkv, D, hidden, inter, vocab, n_layers, page, num_pages = 8, 2, 64, 512, 1024, 300, 2, 16, 256
    names = ext.layer_slots()
    none = torch.empty(0)
    for i in range(calls):
        def layer():
            slots = dict.fromkeys(names, none)
            slots.update(ln1=torch.ones(hidden), ln2=torch.ones(hidden), qkv_w=q8_blocks((H + 2 * Hkv) * D, hidden, g),
                         o_w=q8_blocks(hidden, H * D, g), gate_up_w=q8_blocks(2 * inter, hidden, g),
                         down_w=q8_blocks(hidden, inter, g))
            if i % 2:
                for w, k in (("qkv_w", hidden), ("o_w", H * D), ("gate_up_w", hidden), ("down_w", inter)):
                    slots[w] = ext.quant_pack(slots[w], k)
            return [slots[name] for name in names]
        cos, sin = torch.randn(512, D), torch.randn(512, D)
        stack = ext.Stack([layer() for _ in range(n_layers)], 0.02 * torch.randn(vocab, hidden), torch.ones(hidden),
                          0.02 * torch.randn(vocab, hidden), none, none, cos, sin, H, Hkv, D, 1e-5, D ** -0.5)
        seqs = 1 + i % 7
        table, lens, cu = pages(seqs, page, num_pages, g)
        positions = (lens - 1).long()
        slots = (table[torch.arange(seqs), (positions // page)].long() * page + positions % page).contiguous()
        kc = torch.randn(n_layers, num_pages, page, Hkv, D, generator=g)
        vc = torch.randn(n_layers, num_pages, page, Hkv, D, generator=g)
        ids = torch.randint(0, vocab, (seqs,), generator=g)
        logits = ext.forward(stack, ids, positions, slots, table, lens, cu, torch.arange(seqs), kc, vc, True, False)
        del stack, kc, vc, ids, table, lens, cu, positions, slots, cos, sin
        assert logits.shape == (seqs, vocab) and bool(torch.isfinite(logits).all())


def main() -> int:
    t0 = time.perf_counter()
    ext = build()
    print(f"built with AddressSanitizer in {time.perf_counter() - t0:.0f} s: {ext.__file__}", flush=True)
    g = torch.Generator().manual_seed(0)
    for threads in (1, 2, 3, 4):
        torch.set_num_threads(threads)
        t = time.perf_counter()
        matmuls(ext, g, 300)
        attentions(ext, g, 300)
        forwards(ext, g, 40)
        print(f"threads {threads}: 300 quant_linear, 300 pooled attention, 40 forwards, every input freed after "
              f"its call: clean ({time.perf_counter() - t:.1f} s)", flush=True)
    ext.drain_pool()
    print("AddressSanitizer reported nothing")
    return 0


if __name__ == "__main__":
    sys.exit(main())
