"""Paged attention's torch reference: each sequence's context gathered from its pages, and the
attention of a query against gathered rows (the oracle every kernel is tested against, and the
model's CPU path without the compiled extension). Shapes as in decode_attention.py; an 8-bit
cache's rows are widened with their scales (kernels/kv_quant.py) before attending in float32."""
from __future__ import annotations

import torch

from .kv_quant import dequantize


def gather_pages(cache: torch.Tensor, page_table: torch.Tensor, n_tokens: int,
                 scale: torch.Tensor | None = None) -> torch.Tensor:
    """(num_pages, page, H, D) cache -> (B, n_tokens, H, D) contiguous context per sequence; with an
    8-bit cache's scale (num_pages, page, H, 1), the rows read back in float32."""
    if scale is not None:
        return dequantize(gather_pages(cache.view(torch.uint8), page_table, n_tokens).view(cache.dtype),
                          gather_pages(scale, page_table, n_tokens))
    page_size = cache.shape[1]
    n_pages = -(-n_tokens // page_size)
    pages = page_table[:, :n_pages].long().clamp(min=0)              # (B, n_pages)
    ctx = cache[pages]                                                # (B, n_pages, page, H, D)
    return ctx.reshape(pages.shape[0], n_pages * page_size, *cache.shape[2:])[:, :n_tokens]


def context_slots(page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int, n_tokens: int):
    """Flat cache slots (B, n_tokens) of each sequence's positions 0..n_tokens-1, and a mask
    (B, n_tokens): True where the position exists (pos < seq_len). Slots past the end point at
    whatever page the table pads with; attend_gathered never lets what they hold through.

        position p of sequence b  ->  slot page_table[b, p // page_size] * page_size + p % page_size
    """
    pos = torch.arange(n_tokens, device=page_table.device)
    pages = page_table[:, pos // page_size].long().clamp(min=0)      # (B, L)
    valid = pos[None, :] < seq_lens[:, None].long()
    return pages * page_size + pos % page_size, valid


def attend_gathered(q, k_flat, v_flat, slots, valid, scale: float, k_scale_flat=None, v_scale_flat=None):
    """q (B, Hq, D) against the cache rows `slots` (B, L) of k_flat / v_flat (rows, Hkv, D),
    where `valid` (B, L) says which rows belong to the sequence. Shared by the reference and the
    model's CPU path, which computes slots and mask once per step for all layers. An 8-bit
    cache's scales come as k_scale_flat / v_scale_flat (rows, Hkv, 1).

    Rows outside the sequence may hold anything (a free page, another request's tail, NaN):
    their K and V are zeroed and their scores set to -inf with `where`, never by adding -inf,
    which would leave NaN * 0 = NaN in the output."""
    B, L = slots.shape
    Hkv, D = k_flat.shape[1], k_flat.shape[2]
    acc = torch.promote_types(q.dtype, torch.float32)     # float32, or float64 for a float64 oracle
    rows = slots.reshape(-1)
    if k_scale_flat is not None:     # 8-bit rows gathered through their bytes, read back in float32
        k = dequantize(k_flat.view(torch.uint8).view(k_flat.shape[0], -1).index_select(0, rows)
                       .view(k_flat.dtype).view(B, L, Hkv, D), k_scale_flat[rows].view(B, L, Hkv, 1))
        v = dequantize(v_flat.view(torch.uint8).view(v_flat.shape[0], -1).index_select(0, rows)
                       .view(v_flat.dtype).view(B, L, Hkv, D), v_scale_flat[rows].view(B, L, Hkv, 1))
    else:
        k = k_flat.view(k_flat.shape[0], -1).index_select(0, rows).view(B, L, Hkv, D)
        v = v_flat.view(v_flat.shape[0], -1).index_select(0, rows).view(B, L, Hkv, D)
    keep = valid[:, :, None, None]
    if not bool(valid.all()):
        k = torch.where(keep, k, 0)
        v = torch.where(keep, v, 0)
    k, v = k.transpose(1, 2), v.transpose(1, 2)                        # (B, Hkv, L, D)
    if k.dtype != acc:
        k, v = k.to(acc), v.to(acc)
    qg = q.view(B, Hkv, -1, D).to(acc)                                 # (B, Hkv, G, D)
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale             # (B, Hkv, G, L)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v)              # (B, Hkv, G, D)
    return out.reshape(q.shape).to(q.dtype)


def paged_decode_attention_ref(q, k_cache, v_cache, page_table, seq_lens, scale: float, k_scale=None, v_scale=None):
    page_size = k_cache.shape[1]
    slots, valid = context_slots(page_table, seq_lens, page_size, int(seq_lens.max()))
    return attend_gathered(q, k_cache.flatten(0, 1), v_cache.flatten(0, 1), slots, valid, scale,
                           *flat_scales(k_scale, v_scale))


def flat_scales(k_scale, v_scale) -> tuple:
    """An 8-bit cache's scales (pages, page, Hkv, 1) as rows by slot (slots, Hkv, 1); (None, None)."""
    if k_scale is None:
        return None, None
    return k_scale.flatten(0, 1), v_scale.flatten(0, 1)



def merge_partials_ref(part_out: torch.Tensor, part_lse: torch.Tensor, own_splits: torch.Tensor) -> torch.Tensor:
    """The merge's math in float64: part_out (B, H, S, D) float32 (each split's softmax-weighted
    values, normalised within the split), part_lse (B, H, S) (log2 of each split's sum of
    exp2(scores), -inf for an empty split), own_splits (B,) (splits the sequence has) ->
    (B, H, D) float64 = sum_s 2**lse_s * out_s / sum_s 2**lse_s over the sequence's own splits."""
    S = part_lse.shape[-1]
    own = torch.arange(S, device=part_lse.device)[None, :] < own_splits[:, None].long()   # (B, S)
    lse = part_lse.double().masked_fill(~own[:, None, :], float("-inf"))                   # (B, H, S)
    w = torch.exp2(lse - lse.max(dim=-1, keepdim=True).values)                            # (B, H, S)
    out = part_out.double().masked_fill(~own[:, None, :, None], 0.0)
    return (w[..., None] * out).sum(-2) / w.sum(-1, keepdim=True)
