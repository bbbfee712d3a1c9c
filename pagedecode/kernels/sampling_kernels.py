"""The sampler's three Triton kernels (sampling.py launches them from `sample_triton`, and holds
the semantics and the torch reference they match bit for bit).

Kernel plan (three launches; row-selection steps in row_select.py). The vocabulary is cut
into tiles (4096 tokens on the GPU), so a batch of 64 rows runs 64 x 32 programs, not 64:
    1. per (row, tile): penalties, bias and mask applied (the processed tile written once); the
       tile's max / sum-exp / first argmax of the logits and max of z; for a row with a small
       top-k (k <= TILE_CANDIDATES) the tile's top-TILE_CANDIDATES z by a radix select in
       registers (sorting-free), kept with their token ids
    2. per (row, tile), rows without top-k or top-p only: the tile's best z + noise over the
       min-p set, and its token
    3. per row: the tiles merged: logprob and greedy token; a small top-k row takes the k-th
       value of its tiles' candidates (radix select), min-p, top-p (bisection over the
       candidates' mass) and the draw in registers; a temperature / min-p row takes the best of
       its tiles' draws; any other row (top-p without a small top-k, or ties at a tile's last
       candidate reaching the k-th value) selects by passes over its row (_select_row).
Every path keeps the same set and draws the same noise, so all give the reference's token.
"""
from __future__ import annotations

from ._backend import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .penalties import _penalize
    from .philox import _philox_gumbel
    from .row_select import _from_order_key, _kth_key, _order_key, _pick, _select_row, _tile_top_p

    @triton.jit
    def _row_settings(row, slot_ptr, temp_ptr, topk_ptr, topp_ptr, lminp_ptr, seed_ptr, HAS_SLOTS: tl.constexpr):
        if HAS_SLOTS:
            at = tl.load(slot_ptr + row).to(tl.int64)
        else:
            at = row.to(tl.int64)
        temp = tl.load(temp_ptr + at)
        return (temp, tl.where(temp > 0, temp, 1.0), tl.load(topk_ptr + at), tl.load(topp_ptr + at),
                tl.load(lminp_ptr + at), tl.load(seed_ptr + at))

    @triton.jit
    def _tile_kernel(logits_ptr, stride_row, V, slot_ptr, temp_ptr, topk_ptr, topp_ptr, lminp_ptr, seed_ptr,
                     proc_ptr, state_slot_ptr, rep_ptr, pres_ptr, freq_ptr, active_ptr, counts_ptr, seen_ptr,
                     bias_ptr, mask_ptr, mask_words,
                     tile_m_ptr, tile_l_ptr, tile_arg_ptr, tile_zmax_ptr, tile_n_ptr, tile_key_ptr,
                     cand_z_ptr, cand_i_ptr,
                     TILE: tl.constexpr, CAND: tl.constexpr,
                     HAS_SLOTS: tl.constexpr, HAS_PENALTIES: tl.constexpr, HAS_MASK: tl.constexpr):
        """Pass 1, one program per (row, vocab tile): penalties, bias and mask applied (the
        processed tile written once), the tile's raw max / sum-exp / first argmax and z max, and
        for a small top-k row the tile's top-CAND candidates (every z above the tile's CAND-th
        largest, then ties with it in token order while room is left)."""
        row = tl.program_id(0)
        tile = tl.program_id(1)
        at_tile = row.to(tl.int64) * tl.num_programs(1) + tile
        temp, div, top_k, top_p, log_min_p, seed = _row_settings(row, slot_ptr, temp_ptr, topk_ptr, topp_ptr,
                                                                lminp_ptr, seed_ptr, HAS_SLOTS)
        offs = tile * TILE + tl.arange(0, TILE)
        ok = offs < V
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + offs, mask=ok, other=float("-inf")).to(tl.float32)
        if HAS_PENALTIES:
            state_slot = tl.load(state_slot_ptr + row).to(tl.int64)
            if tl.load(active_ptr + state_slot) != 0:
                x = _penalize(x, offs, ok, state_slot * V, tl.load(rep_ptr + state_slot),
                              tl.load(pres_ptr + state_slot), tl.load(freq_ptr + state_slot),
                              counts_ptr, seen_ptr, bias_ptr)
        if HAS_MASK:     # the grammar's bitmask: bit offs % 32 of word offs // 32
            word = tl.load(mask_ptr + row.to(tl.int64) * mask_words + offs // 32, mask=ok, other=0)
            x = tl.where(((word >> (offs % 32)) & 1) != 0, x, float("-inf"))
        if HAS_PENALTIES or HAS_MASK:
            tl.store(proc_ptr + row.to(tl.int64) * V + offs, x, mask=ok)
        m = tl.max(x, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        tl.store(tile_m_ptr + at_tile, m)
        tl.store(tile_l_ptr + at_tile, tl.sum(tl.exp(x - m_safe), 0))
        tl.store(tile_arg_ptr + at_tile, tl.min(tl.where(ok & (x == m), offs, V), 0))
        z = x / div + 0.0
        tl.store(tile_zmax_ptr + at_tile, tl.max(z, 0))
        if (temp > 0) & (top_k > 0) & (top_k <= CAND) & (top_k < V):
            u = tl.where(ok, _order_key(z) + 0x80000000, 0)         # unsigned order keys; 0: no token
            kth = _kth_key(u, CAND)
            above = ok & (u > kth)
            tie = ok & (u == kth)
            n_above = tl.sum(above.to(tl.int32), 0)
            rank = tl.where(above, tl.cumsum(above.to(tl.int32), 0) - 1,
                            n_above + tl.cumsum(tie.to(tl.int32), 0) - 1)
            keep = (above | tie) & (rank < CAND)
            tl.store(cand_z_ptr + at_tile * CAND + rank, z, mask=keep)
            tl.store(cand_i_ptr + at_tile * CAND + rank, offs, mask=keep)
            # tokens of the tile at or above its CAND-th key: more than CAND means ties were left out
            tl.store(tile_n_ptr + at_tile, n_above + tl.sum(tie.to(tl.int32), 0))
            tl.store(tile_key_ptr + at_tile, kth)

    @triton.jit
    def _tile_draw_kernel(base_ptr, V, slot_ptr, index_ptr, temp_ptr, topk_ptr, topp_ptr, lminp_ptr, seed_ptr,
                          tile_zmax_ptr, draw_score_ptr, draw_at_ptr,
                          TILE: tl.constexpr, BLOCK_T: tl.constexpr, HAS_SLOTS: tl.constexpr):
        """Pass 2, per (row, vocab tile), for rows without top-k or top-p (temperature, min-p):
        the tile's best z + Gumbel noise over z >= max(z) + log(min_p), and its first token."""
        row = tl.program_id(0)
        tile = tl.program_id(1)
        T = tl.num_programs(1)
        temp, div, top_k, top_p, log_min_p, seed = _row_settings(row, slot_ptr, temp_ptr, topk_ptr, topp_ptr,
                                                                lminp_ptr, seed_ptr, HAS_SLOTS)
        if (temp > 0) & (top_p >= 1.0) & ((top_k <= 0) | (top_k >= V)):
            t = tl.arange(0, BLOCK_T)
            zmax = tl.max(tl.load(tile_zmax_ptr + row.to(tl.int64) * T + t, mask=t < T, other=float("-inf")), 0)
            thr = zmax + log_min_p
            offs = tile * TILE + tl.arange(0, TILE)
            ok = offs < V
            z = tl.load(base_ptr + row.to(tl.int64) * V + offs, mask=ok, other=float("-inf")).to(tl.float32) / div + 0.0
            index = tl.load(index_ptr + row)
            score = tl.where(ok & (z >= thr), z + _philox_gumbel(seed, index, offs), float("-inf"))
            top = tl.max(score, 0)
            tl.store(draw_score_ptr + row.to(tl.int64) * T + tile, top)
            tl.store(draw_at_ptr + row.to(tl.int64) * T + tile, tl.min(tl.where(score == top, offs, V), 0))

    @triton.jit
    def _finish_kernel(base_ptr, V, tokens_ptr, logprobs_ptr, slot_ptr, index_ptr, temp_ptr, topk_ptr, topp_ptr,
                       lminp_ptr, seed_ptr, num_tiles,
                       tile_m_ptr, tile_l_ptr, tile_arg_ptr, tile_zmax_ptr, tile_n_ptr, tile_key_ptr,
                       cand_z_ptr, cand_i_ptr, draw_score_ptr, draw_at_ptr, row_z_ptr, row_i_ptr,
                       CAND: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
                       SEARCH_STEPS: tl.constexpr, BLOCK_C: tl.constexpr, HAS_SLOTS: tl.constexpr):
        """Pass 3, one program per row: the tiles' statistics merged (logprob, greedy token), then
        the token: a small top-k row from its tiles' candidates in registers (top-k, min-p, top-p
        and the draw), a temperature / min-p row from the tiles' draws, anything else (top-p
        without a small top-k, or ties at a tile's CAND-th value reaching the k-th) by passes over
        the row (_select_row)."""
        row = tl.program_id(0)
        temp, div, top_k, top_p, log_min_p, seed = _row_settings(row, slot_ptr, temp_ptr, topk_ptr, topp_ptr,
                                                                lminp_ptr, seed_ptr, HAS_SLOTS)
        index = tl.load(index_ptr + row)
        t = tl.arange(0, BLOCK_T)
        t_ok = t < num_tiles
        at_tiles = row.to(tl.int64) * num_tiles + t
        m_t = tl.load(tile_m_ptr + at_tiles, mask=t_ok, other=float("-inf"))
        l_t = tl.load(tile_l_ptr + at_tiles, mask=t_ok, other=0.0)
        m_raw = tl.max(m_t, 0)
        m_safe = tl.where(m_raw == float("-inf"), 0.0, m_raw)
        l_raw = tl.sum(l_t * tl.exp(tl.where(t_ok, m_t, float("-inf")) - m_safe), 0)
        arg_t = tl.load(tile_arg_ptr + at_tiles, mask=t_ok, other=V)
        token = tl.min(tl.where(t_ok & (m_t == m_raw), arg_t, V), 0)           # greedy: first maximum
        zmax = tl.max(tl.load(tile_zmax_ptr + at_tiles, mask=t_ok, other=float("-inf")), 0)
        base = base_ptr + row.to(tl.int64) * V
        if temp > 0:
            if (top_k > 0) & (top_k <= CAND) & (top_k < V):
                n_t = tl.load(tile_n_ptr + at_tiles, mask=t_ok, other=0)
                c = tl.arange(0, CAND)
                live2 = t_ok[:, None] & (c[None, :] < tl.minimum(n_t, CAND)[:, None])    # (BLOCK_T, CAND)
                at2 = at_tiles[:, None] * CAND + c[None, :]
                live = tl.reshape(live2, [BLOCK_T * CAND])
                z = tl.reshape(tl.load(cand_z_ptr + at2, mask=live2, other=float("-inf")), [BLOCK_T * CAND])
                ids = tl.reshape(tl.load(cand_i_ptr + at2, mask=live2, other=0), [BLOCK_T * CAND])
                kth = _kth_key(tl.where(live, _order_key(z) + 0x80000000, 0), top_k)
                tile_key = tl.load(tile_key_ptr + at_tiles, mask=t_ok, other=0)
                # a tile that left ties out at or above the k-th value: its candidates are not all of them
                short = tl.sum((t_ok & (n_t > CAND) & (tile_key >= kth)).to(tl.int32), 0) > 0
                if short:
                    token = _select_row(base, V, div, top_k, top_p, log_min_p, zmax, seed, index,
                                        row_z_ptr + row.to(tl.int64) * BLOCK_C, row_i_ptr + row.to(tl.int64) * BLOCK_C,
                                        BLOCK_V, SEARCH_STEPS, BLOCK_C)
                else:
                    thr = tl.maximum(_from_order_key(kth - 0x80000000), zmax + log_min_p)
                    keep = live & (z >= thr)
                    if top_p < 1.0:
                        thr = tl.maximum(thr, _tile_top_p(z, keep, thr, zmax, top_p, SEARCH_STEPS))
                    token = _pick(z, ids, keep & (z >= thr), seed, index, V)
            elif (top_p >= 1.0) & ((top_k <= 0) | (top_k >= V)):
                score = tl.load(draw_score_ptr + at_tiles, mask=t_ok, other=float("-inf"))
                at = tl.load(draw_at_ptr + at_tiles, mask=t_ok, other=V)
                token = tl.min(tl.where(t_ok & (score == tl.max(score, 0)), at, V), 0)
            else:
                token = _select_row(base, V, div, top_k, top_p, log_min_p, zmax, seed, index,
                                    row_z_ptr + row.to(tl.int64) * BLOCK_C, row_i_ptr + row.to(tl.int64) * BLOCK_C,
                                    BLOCK_V, SEARCH_STEPS, BLOCK_C)
        x_tok = tl.load(base + token).to(tl.float32)
        tl.store(tokens_ptr + row, token.to(tl.int64))
        tl.store(logprobs_ptr + row, x_tok - (m_raw + tl.log(l_raw)))

