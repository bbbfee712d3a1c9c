"""Paged decode attention: one new query token per sequence against its whole cached context.

Shapes:
    q           (B, q_heads, head_dim)
    k_cache     (num_pages, page_size, kv_heads, head_dim), v_cache the same
    page_table  (B, max_pages) int32: logical page i of sequence b is page_table[b, i]; -1 unused
    seq_lens    (B,) int32: tokens in cache for each sequence (the new token's K/V included)
    returns     (B, q_heads, head_dim) in q's dtype

Query head h reads KV head h // (q_heads // kv_heads) (grouped-query attention).

An 8-bit cache (kernels/kv_quant.py) comes with k_scale, v_scale (num_pages, page_size, kv_heads, 1)
bfloat16; every path widens each row to float32 times its scale and attends in float32, as it
widens a float16 cache.
"""
from __future__ import annotations

import functools
import math
from typing import Literal

import torch

from ._backend import HAS_TRITON, dot_dtype, interpreting, use_triton
from .attention_ref import paged_decode_attention_ref

if HAS_TRITON:
    import triton
    import triton.language as tl

# Flash-decoding: a sequence's context is cut into splits of `split_tokens` tokens, one program
# per (sequence, KV head, split), and a second kernel merges the splits' partial (output,
# log-sum-exp) pairs.
#
# Deterministic mode: splits of SPLIT_TOKENS, fixed, never derived from the batch, so a sequence's
# result is the same whichever batch it is in (the merge always sees the same partials in the
# same order). The number of split programs follows the batch's longest sequence, but a shorter
# sequence's extra splits are empty and its merge stops at its own last split, so it runs exactly
# the operations it runs alone; extend attention's deterministic mode relies on this.
SPLIT_TOKENS = 256
Finish = Literal["direct", "merge", "partials"]
# Otherwise split_tokens_for() sizes the splits so the grid fills the GPU (heuristic there).
WAVES = 2               # programs wanted: WAVES x SMs (one wave leaves SMs idle at the tail)
MAX_SPLITS = 64         # more splits add merge work and partial traffic for little gain
MIN_SPLIT_TOKENS = 256  # below this a split's fixed cost (q load, partial write) outweighs its tokens
MERGE_BLOCK = 16        # splits the merge folds per step (fixed: the merge order never depends on the batch)


def split_tokens_for(batch: int, kv_heads: int, max_len: int, num_sms: int, block_n: int) -> int:
    """Split length for a non-deterministic launch. The (sequence, KV head) programs alone fill
    batch * kv_heads slots; when that is under WAVES waves of the SMs, each sequence is cut into
    ceil(WAVES * num_sms / (batch * kv_heads)) splits, at most MAX_SPLITS and none shorter than
    MIN_SPLIT_TOKENS; the length is rounded up to the kernel's tile (block_n).

    8B shape (8 KV heads) on 132 SMs: B=64 -> 1 split; B=32 -> 2; B=8 -> 5; B=1 x 32k -> 32
    splits of 1024 tokens; SmolLM2 (3 KV heads) B=1 x 32k -> 64 splits of 512."""
    programs = max(1, batch * kv_heads)
    splits = min(MAX_SPLITS, -(-WAVES * num_sms // programs))
    splits = max(1, min(splits, max_len // MIN_SPLIT_TOKENS))
    length = -(-max(1, max_len) // splits)
    return -(-length // block_n) * block_n


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; on CPU (the interpreter) an H200's 132, so
    the heuristic chooses there what it would choose on the GPU."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


if HAS_TRITON:
    @triton.jit
    def _kv_tile(kc_ptr, vc_ptr, ks_ptr, vs_ptr, pt_row, pos, pos_ok, kvh, d, d_ok, stride_cp, stride_co,
                 stride_ch, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr):
        """K and V rows (BLOCK_N, BLOCK_D), as float32, at logical positions `pos` of the sequence
        whose page-table row starts at pt_row. Page ids are promoted to int64 before any stride.
        QUANT: an 8-bit cache (contiguous), each row times its scale, which sits at the row's
        offset / HEAD_DIM in ks_ptr / vs_ptr (one per slot and KV head)."""
        page = tl.load(pt_row + pos // PAGE_SIZE, mask=pos_ok, other=0)
        row = page.to(tl.int64) * stride_cp + (pos % PAGE_SIZE) * stride_co + kvh * stride_ch
        mask = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(kc_ptr + row[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
        v = tl.load(vc_ptr + row[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
        if QUANT:
            k = k * tl.load(ks_ptr + row // HEAD_DIM, mask=pos_ok, other=0.0).to(tl.float32)[:, None]
            v = v * tl.load(vs_ptr + row // HEAD_DIM, mask=pos_ok, other=0.0).to(tl.float32)[:, None]
        return k, v

    @triton.jit
    def _online_softmax_step(m_i, l_i, acc, s, v, DOT_DTYPE: tl.constexpr):
        """Fold one tile of scores s (M, N; log2 units, -inf where hidden) into the running max
        m_i, sum l_i and output acc. The caller guarantees a finite entry per row in the first
        tile it folds, so m_i - m_new is never -inf - -inf."""
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE))
        return m_new, l_i, acc

    @triton.jit
    def _decode_split_kernel(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, pt_ptr, lens_ptr, part_out_ptr, part_lse_ptr,
                             out_ptr, sm_scale_log2,
                             stride_qb, stride_qh, stride_cp, stride_co, stride_ch, stride_ptb,
                             stride_ob, stride_oh, num_splits, split_tokens,
                             GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                             BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_D: tl.constexpr, DOT_DTYPE: tl.constexpr, WRITE_OUT: tl.constexpr,
                             QUANT: tl.constexpr):
        """One (sequence, KV head, split): its query heads against tokens
        [split * split_tokens, min((split + 1) * split_tokens, seq_len)). WRITE_OUT (one split per
        sequence): the normalised output goes straight to out_ptr, bit for bit what the merge
        would write (merging one split multiplies by 2**0 = 1 and divides by 1)."""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(lens_ptr + b)
        g = tl.arange(0, BLOCK_G)                    # query heads of this KV head, padded to >= 16
        d = tl.arange(0, BLOCK_D)
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        heads = kvh * GROUP + g
        q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        q = q.to(DOT_DTYPE)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        start = split * split_tokens
        end = tl.minimum(start + split_tokens, seq_len)
        pt_row = pt_ptr + b.to(tl.int64) * stride_ptb
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)         # logical token positions of this tile
            pos_ok = pos < end
            k, v = _kv_tile(kc_ptr, vc_ptr, ks_ptr, vs_ptr, pt_row, pos, pos_ok, kvh, d, d_ok, stride_cp, stride_co,
                            stride_ch, PAGE_SIZE, HEAD_DIM, QUANT)
            s = tl.dot(q, tl.trans(k.to(DOT_DTYPE))) * sm_scale_log2          # (G, N), log2 units
            s = tl.where(pos_ok[None, :], s, float("-inf"))
            m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, s, v, DOT_DTYPE)
        # an empty split (start >= seq_len) leaves l_i = 0: write lse = -inf and zeros, never 0/0
        has = l_i > 0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        if WRITE_OUT:
            tl.store(out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
        else:
            lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
            q_heads = GROUP * tl.num_programs(1)
            base = (b.to(tl.int64) * q_heads + heads) * num_splits + split      # (BLOCK_G,)
            tl.store(part_out_ptr + base[:, None] * HEAD_DIM + d[None, :], out,
                     mask=g_ok[:, None] & d_ok[None, :])
            tl.store(part_lse_ptr + base, lse, mask=g_ok)

    @triton.jit
    def _decode_merge_kernel(part_out_ptr, part_lse_ptr, lens_ptr, out_ptr, stride_ob, stride_oh, num_splits,
                             split_tokens,
                             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
        """One (sequence, query head): folds its own splits BLOCK_S at a time (loads of a whole
        block in flight at once, not one dependent load per split), in split order."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        s = tl.arange(0, BLOCK_S)
        base = (b.to(tl.int64) * tl.num_programs(1) + h) * num_splits
        m = tl.full([1], float("-inf"), tl.float32)
        total = tl.zeros([1], tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        # this sequence's own splits only: the batch's longest sequence sets num_splits, and folding
        # an empty split in (x * 1 + 0) could still turn an exact -0 into +0
        own_splits = tl.cdiv(tl.load(lens_ptr + b), split_tokens)
        for s0 in range(0, own_splits, BLOCK_S):
            at = s0 + s
            ok = at < own_splits
            lse = tl.load(part_lse_ptr + base + at, mask=ok, other=float("-inf"))               # (S,)
            part = tl.load(part_out_ptr + (base + at)[:, None] * HEAD_DIM + d[None, :],
                           mask=ok[:, None] & d_ok[None, :], other=0.0)                         # (S, D)
            m_new = tl.maximum(m, tl.max(lse, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # all splits so far empty
            scale_old = tl.exp2(m - m_safe)
            w = tl.exp2(lse - m_safe)                                # (S,); 0 for masked and empty splits
            total = total * scale_old + tl.sum(w, 0)
            acc = acc * scale_old + tl.sum(w[:, None] * part, 0)
            m = m_new
        out = acc / total
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + d,
                 out.to(out_ptr.dtype.element_ty), mask=d_ok)


def decode_partials(q, k_cache, v_cache, page_table, seq_lens, scale: float, split_tokens: int,
                    block_n: int | None = None, num_warps: int = 4, num_stages: int = 2):
    """The split kernel alone: (part_out (B, Hq, S, D) float32, part_lse (B, Hq, S) float32,
    S = splits of the longest sequence). For tests of the merge against merge_partials_ref."""
    return _launch(q, k_cache, v_cache, page_table, seq_lens, scale, split_tokens, block_n, num_warps,
                   num_stages, "partials")


def _launch(q, k_cache, v_cache, page_table, seq_lens, scale: float, split_tokens: int, block_n: int | None,
            num_warps: int, num_stages: int, finish: Finish, max_len: int | None = None, k_scale=None,
            v_scale=None):
    """finish: "direct" (one split per sequence: the split kernel writes the output), "merge"
    (split kernel, then the merge kernel), "partials" (the split kernel's partials, unmerged)."""
    B, Hq, D = q.shape
    page_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hkv
    assert Hq % Hkv == 0 and q.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride() and page_table.stride(-1) == 1
    quant = k_scale is not None
    assert not quant or (k_cache.is_contiguous() and v_scale is not None and k_scale.is_contiguous()
                         and v_scale.is_contiguous())
    block_n = block_n or (16 if interpreting() else 64)
    assert split_tokens % block_n == 0 and block_n >= 16
    num_splits = max(1, -(-(int(seq_lens.max()) if max_len is None else max_len) // split_tokens))
    direct = finish == "direct"
    part_out = torch.empty((B, Hq, num_splits, D), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((B, Hq, num_splits), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    block_g = max(16, triton.next_power_of_2(group))      # tl.dot needs M >= 16 on NVIDIA
    block_d = max(16, triton.next_power_of_2(D))
    _decode_split_kernel[(B, Hkv, num_splits)](
        q, k_cache, v_cache, k_scale if quant else k_cache, v_scale if quant else v_cache, page_table, seq_lens,
        part_out, part_lse, out,
        scale * 1.4426950408889634,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        page_table.stride(0), out.stride(0), out.stride(1), num_splits, split_tokens,
        GROUP=group, HEAD_DIM=D, PAGE_SIZE=page_size, BLOCK_G=block_g,
        BLOCK_N=block_n, BLOCK_D=block_d, DOT_DTYPE=dot_dtype(q), WRITE_OUT=direct, QUANT=quant,
        num_warps=num_warps, num_stages=num_stages)
    if direct:
        return out
    if finish == "partials":
        return part_out, part_lse
    _decode_merge_kernel[(B, Hq)](part_out, part_lse, seq_lens, out, out.stride(0), out.stride(1), num_splits,
                                  split_tokens, HEAD_DIM=D, BLOCK_D=block_d, BLOCK_S=MERGE_BLOCK)
    return out


def paged_decode_attention_triton(q, k_cache, v_cache, page_table, seq_lens, scale: float,
                                  split_tokens: int | None = None, deterministic: bool = False,
                                  block_n: int | None = None, num_warps: int = 4, num_stages: int = 2,
                                  max_seq_len: int | None = None, k_scale=None, v_scale=None):
    """split_tokens None: SPLIT_TOKENS in deterministic mode, else split_tokens_for()'s choice.
    A launch whose sequences all fit one split skips the merge (outside deterministic mode, whose
    bits must not depend on whether a longer sequence shares the batch). Launch parameters are
    arguments so benchmarks/kernel_sweep.py --sweep can compare them. max_seq_len: a host bound
    on seq_lens (a CUDA graph's), read instead of seq_lens (no device-to-host copy)."""
    block_n = block_n or (16 if interpreting() else 64)
    max_len = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    if split_tokens is None:
        split_tokens = SPLIT_TOKENS if deterministic else split_tokens_for(
            q.shape[0], k_cache.shape[2], max_len, sm_count(q.device), block_n)
    one_split = max_len <= split_tokens
    finish: Finish = "direct" if one_split and not deterministic else "merge"
    return _launch(q, k_cache, v_cache, page_table, seq_lens, scale, split_tokens, block_n, num_warps,
                   num_stages, finish, max_len, k_scale, v_scale)


def paged_decode_attention(q, k_cache, v_cache, page_table, seq_lens, scale: float | None = None,
                           backend: str = "auto", deterministic: bool = False, max_seq_len: int | None = None,
                           k_scale=None, v_scale=None):
    """Attention of one query token per sequence over its paged context (see module docstring).
    On CUDA tensors (backend "auto") the split-KV Triton kernel, its splits sized by
    split_tokens_for(); deterministic: fixed SPLIT_TOKENS splits (batch-invariant bits).
    max_seq_len: a host bound on seq_lens that sizes the splits instead of seq_lens' own maximum
    (which costs a device-to-host copy, impossible inside a CUDA graph). k_scale, v_scale: an
    8-bit cache's scales (module docstring), else None."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if use_triton(q, backend):
        return paged_decode_attention_triton(q, k_cache, v_cache, page_table, seq_lens, scale,
                                             deterministic=deterministic, max_seq_len=max_seq_len,
                                             k_scale=k_scale, v_scale=v_scale)
    return paged_decode_attention_ref(q, k_cache, v_cache, page_table, seq_lens, scale, k_scale, v_scale)
