"""Prefill / extend attention over paged KV: new tokens attend, causally, to a cached prefix
plus themselves. The new tokens' K/V are already in the cache (written by write_kv first).

Shapes:
    q           (T, q_heads, head_dim): the new tokens of all sequences, packed in order
    k_cache     (num_pages, page_size, kv_heads, head_dim), v_cache the same
    page_table  (S, max_pages) int32
    cu_q        (S + 1,) int32: sequence s owns q rows cu_q[s] : cu_q[s + 1]
    seq_lens    (S,) int32: cached tokens after the write, prefix + new
    returns     (T, q_heads, head_dim)
    k_scale, v_scale   an 8-bit cache's scales (num_pages, page_size, kv_heads, 1), else None

Positions: sequence s has n = cu_q[s+1] - cu_q[s] new tokens at logical positions
seq_len - n .. seq_len - 1; new token i sees cache positions 0 .. seq_len - n + i.
A prefix of 0 (plain prefill) and n = 1 (a decode step) are both allowed.

Deterministic mode (`deterministic=True`, Triton path): every new token is attended as a decode
query of its own, by decode_attention's kernel, over the context it sees (its sequence's pages,
length position + 1). A query's bits then depend only on its position and context, never on
the chunk it came in, the other tokens of its chunk or the batch: the same fixed 256-token
splits, the same tiles inside each split, the same tile shapes in every tl.dot and the same
merge order as the decode step that would compute it (one compiled kernel; only the grid
differs). The price: each token reads its context itself (the default kernel reads it once per
block of tokens), and a decode tile pads the head group to 16 rows.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._backend import HAS_TRITON, dot_dtype, interpreting, use_triton
from .attention_ref import gather_pages
from .decode_attention import SPLIT_TOKENS, paged_decode_attention

if HAS_TRITON:
    from .decode_attention import _kv_tile, _online_softmax_step

if HAS_TRITON:
    import triton
    import triton.language as tl


def paged_extend_attention_ref(q, k_cache, v_cache, page_table, cu_q, seq_lens, scale: float, k_scale=None,
                               v_scale=None):
    acc = torch.promote_types(q.dtype, torch.float32)     # float32, or float64 for a float64 oracle
    out = torch.empty_like(q)
    cu = cu_q.tolist()
    for s, L in enumerate(seq_lens.tolist()):
        lo, hi = cu[s], cu[s + 1]
        n = hi - lo
        if n == 0:
            continue
        k = gather_pages(k_cache, page_table[s:s + 1], L, k_scale)[0].to(acc).transpose(0, 1)   # (Hkv, L, D)
        v = gather_pages(v_cache, page_table[s:s + 1], L, v_scale)[0].to(acc).transpose(0, 1)
        # query i sits at position L - n + i and sees keys 0 .. L - n + i
        if n == L:          # no cached prefix: the plain causal mask
            mask, causal = None, True
        else:
            mask = torch.arange(L, device=q.device)[None, :] <= torch.arange(L - n, L, device=q.device)[:, None]
            causal = False
        o = F.scaled_dot_product_attention(q[lo:hi].to(acc).transpose(0, 1), k, v, attn_mask=mask,
                                           is_causal=causal, scale=scale, enable_gqa=True)   # (Hq, n, D)
        out[lo:hi] = o.transpose(0, 1).to(q.dtype)
    return out


if HAS_TRITON:
    @triton.jit
    def _extend_kernel(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, pt_ptr, cu_ptr, lens_ptr, out_ptr, sm_scale_log2,
                       stride_qt, stride_qh, stride_ot, stride_oh,
                       stride_cp, stride_co, stride_ch, stride_ptb,
                       GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                       PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_D: tl.constexpr, DOT_DTYPE: tl.constexpr, QUANT: tl.constexpr):
        # one program: BLOCK_M new tokens of one sequence x all GROUP query heads of one KV head,
        # packed as rows r = token * GROUP_PAD + head, so each K/V tile is loaded once per group
        s = tl.program_id(0)
        kvh = tl.program_id(1)
        mblk = tl.program_id(2)
        q_lo = tl.load(cu_ptr + s)
        n_new = tl.load(cu_ptr + s + 1) - q_lo
        if mblk * BLOCK_M < n_new:
            seq_len = tl.load(lens_ptr + s)
            prefix = seq_len - n_new
            r = tl.arange(0, BLOCK_M * GROUP_PAD)
            i = mblk * BLOCK_M + r // GROUP_PAD       # index among the new tokens
            g = r % GROUP_PAD
            row_ok = (i < n_new) & (g < GROUP)
            q_pos = prefix + i                        # logical position of each row's token
            heads = kvh * GROUP + g
            d = tl.arange(0, BLOCK_D)
            d_ok = d < HEAD_DIM
            tok = (q_lo + i).to(tl.int64)
            q = tl.load(q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                        mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32).to(DOT_DTYPE)
            m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
            acc = tl.zeros([BLOCK_M * GROUP_PAD, BLOCK_D], tl.float32)
            # keys 0 .. last query position of this block; key 0 is visible to every row, so the
            # running max is finite after the first tile and no row ever computes -inf - -inf
            kv_end = tl.minimum(prefix + (mblk + 1) * BLOCK_M, seq_len)
            pt_row = pt_ptr + s.to(tl.int64) * stride_ptb
            for n0 in range(0, kv_end, BLOCK_N):
                pos = n0 + tl.arange(0, BLOCK_N)
                pos_ok = pos < kv_end
                k, v = _kv_tile(kc_ptr, vc_ptr, ks_ptr, vs_ptr, pt_row, pos, pos_ok, kvh, d, d_ok, stride_cp,
                                stride_co, stride_ch, PAGE_SIZE, HEAD_DIM, QUANT)
                sc = tl.dot(q, tl.trans(k.to(DOT_DTYPE))) * sm_scale_log2        # (rows, N)
                visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
                sc = tl.where(visible, sc, float("-inf"))
                m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, sc, v, DOT_DTYPE)
            out = acc / l_i[:, None]
            tl.store(out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def paged_extend_attention_triton(q, k_cache, v_cache, page_table, cu_q, seq_lens, scale: float,
                                  max_new: int | None = None, block_rows: int | None = None,
                                  block_n: int | None = None, num_warps: int = 4, num_stages: int = 2,
                                  k_scale=None, v_scale=None):
    """Launch parameters are arguments so benchmarks/kernel_sweep.py --sweep can compare them.
    block_rows: rows of one program = tokens x (query heads per KV head, padded to a power of 2)."""
    T, Hq, D = q.shape
    S = seq_lens.shape[0]
    page_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    assert Hq % Hkv == 0 and q.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride() and page_table.stride(-1) == 1
    quant = k_scale is not None
    assert not quant or (k_cache.is_contiguous() and v_scale is not None and k_scale.is_contiguous()
                         and v_scale.is_contiguous())
    out = torch.empty_like(q)
    if T == 0:
        return out
    if max_new is None:
        max_new = int((cu_q[1:] - cu_q[:-1]).max())
    group = Hq // Hkv
    group_pad = triton.next_power_of_2(group)
    block_rows = max(block_rows or (16 if interpreting() else 64), group_pad, 16)   # tl.dot: M >= 16
    block_m = block_rows // group_pad                                              # tokens per program
    block_n = block_n or (16 if interpreting() else 64)
    block_d = max(16, triton.next_power_of_2(D))
    grid = (S, Hkv, -(-max_new // block_m))
    _extend_kernel[grid](
        q, k_cache, v_cache, k_scale if quant else k_cache, v_scale if quant else v_cache, page_table, cu_q,
        seq_lens, out, scale * 1.4426950408889634,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), page_table.stride(0),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=D, PAGE_SIZE=page_size, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=block_d, DOT_DTYPE=dot_dtype(q), QUANT=quant, num_warps=num_warps, num_stages=num_stages)
    return out


def extend_rows_as_decode(page_table, cu_q, seq_lens, num_tokens: int):
    """Each packed new token as a decode sequence of its own: (T, max_pages) page-table rows (its
    sequence's) and (T,) lengths (its position + 1), computed on the device without a host sync.

        token t of sequence s (n new tokens, seq_len L): position L - n + (t - cu_q[s])
                                                       = L - (cu_q[s + 1] - t)
    """
    counts = (cu_q[1:] - cu_q[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(counts.shape[0], device=cu_q.device), counts,
                                  output_size=num_tokens)
    t = torch.arange(num_tokens, device=cu_q.device)
    lens = seq_lens.long()[seq] - (cu_q[1:].long()[seq] - t) + 1
    return page_table[seq], lens.to(torch.int32)


# deterministic extend: the decode kernel's float32 partials (rows x q_heads x splits x head_dim)
# stay under this many bytes per launch; tokens beyond it go in further launches (each token's
# result depends on its own row only, so how they are grouped changes no bits)
DETERMINISTIC_PARTIALS_BYTES = 256 * 1024**2


def _extend_as_decode(q, k_cache, v_cache, page_table, cu_q, seq_lens, scale: float, k_scale=None, v_scale=None):
    rows, lens = extend_rows_as_decode(page_table, cu_q, seq_lens, q.shape[0])
    T, Hq, D = q.shape
    splits = -(-int(lens.max()) // SPLIT_TOKENS)
    per_launch = max(1, DETERMINISTIC_PARTIALS_BYTES // (Hq * splits * D * 4))
    if per_launch >= T:
        return paged_decode_attention(q, k_cache, v_cache, rows, lens, scale, backend="triton", deterministic=True,
                                      k_scale=k_scale, v_scale=v_scale)
    out = torch.empty_like(q)
    for i in range(0, T, per_launch):
        out[i:i + per_launch] = paged_decode_attention(q[i:i + per_launch], k_cache, v_cache, rows[i:i + per_launch],
                                                       lens[i:i + per_launch], scale, backend="triton",
                                                       deterministic=True, k_scale=k_scale, v_scale=v_scale)
    return out


def paged_extend_attention(q, k_cache, v_cache, page_table, cu_q, seq_lens, scale: float | None = None,
                           backend: str = "auto", max_new: int | None = None, deterministic: bool = False,
                           k_scale=None, v_scale=None):
    """Causal attention of packed new tokens over cached prefix + themselves (module docstring).
    deterministic: on the Triton path, the bits decode attention gives each token (see above)."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if use_triton(q, backend):
        if deterministic and q.shape[0]:
            return _extend_as_decode(q, k_cache, v_cache, page_table, cu_q, seq_lens, scale, k_scale, v_scale)
        return paged_extend_attention_triton(q, k_cache, v_cache, page_table, cu_q, seq_lens, scale, max_new,
                                             k_scale=k_scale, v_scale=v_scale)
    return paged_extend_attention_ref(q, k_cache, v_cache, page_table, cu_q, seq_lens, scale, k_scale, v_scale)
