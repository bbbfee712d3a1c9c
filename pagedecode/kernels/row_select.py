"""Selection over one row of logits in Triton, the sampling kernel's building blocks
(sampling_kernels.py holds the kernels, sampling.py their torch reference, which the tests hold
these to through it):

    _radix_kth    the k-th largest value, exactly (radix select over order keys, 4 byte passes)
    _bisect       top-p's threshold by bisection over the row (one pass per step)
    _compact      the tokens above a threshold, gathered in token order
    _tile_top_p   top-p's threshold over candidates already in registers
    _pick         argmax of z + Gumbel noise over the kept tokens (first token on a tie)
    _kth_key      the k-th largest of order keys already in registers (radix select)
    _select_row   the whole selection over one row in memory, by passes (the tiled sampler's
                  fallback for top-p without a small top-k, or ties past the candidate tiles)

Values are compared as order keys: float32 bits mapped to integers whose order is the float
order, so a bisection or radix select over keys is one over values.
"""
from __future__ import annotations

from ._backend import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .philox import _philox_gumbel

    @triton.jit
    def _order_key(z):
        # float32 -> int64 whose order is the float order (for a bisection over values)
        bits = z.to(tl.int32, bitcast=True).to(tl.int64)
        return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)

    @triton.jit
    def _from_order_key(key):
        bits = tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.int32)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _bisect(base, V, div, zmax, lo, hi, target, BLOCK_V: tl.constexpr, SEARCH_STEPS: tl.constexpr):
        """The largest value t (as a float) with mass(z >= t) >= target, mass the sum of
        exp(z - zmax), searched over order keys in [lo, hi) with a pass over the row per step.
        Invariant: mass(lo) >= target > mass(hi)."""
        lanes = tl.arange(0, BLOCK_V)
        for _ in range(SEARCH_STEPS):
            mid = lo + (hi - lo) // 2
            acc = tl.zeros([BLOCK_V], tl.float32)
            for v0 in range(0, V, BLOCK_V):
                offs = v0 + lanes
                z = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) / div + 0.0
                acc += tl.where((offs < V) & (_order_key(z) >= mid), tl.exp(z - zmax), 0.0)
            enough = tl.sum(acc, 0) >= target
            lo = tl.where(enough, mid, lo)
            hi = tl.where(enough, hi, mid)
        return _from_order_key(lo)

    @triton.jit
    def _radix_kth(base, V, div, k, BLOCK_V: tl.constexpr):
        """The k-th largest value of z = x / div (ties counted), exactly: a radix select over the
        32-bit order keys, one byte per pass (4 passes of 256-bin histograms)."""
        lanes = tl.arange(0, BLOCK_V)
        bins = tl.arange(0, 512)                      # bin 256 takes the tokens out of the race
        prefix = tl.sum(lanes * 0, 0).to(tl.int64)    # the key bytes chosen so far
        want = k                                      # rank still to find among the eligible
        for d in tl.static_range(4):               # byte d from the top: bits 24 - 8d .. 31 - 8d
            hist = tl.zeros([512], tl.int32)
            for v0 in range(0, V, BLOCK_V):
                offs = v0 + lanes
                z = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) / div + 0.0
                u = _order_key(z) + 0x80000000           # unsigned order, in [0, 2**32)
                eligible = (offs < V) & ((u >> (32 - 8 * d)) == prefix)
                hist += tl.histogram(tl.where(eligible, ((u >> (24 - 8 * d)) & 0xFF).to(tl.int32), 256), 512)
            hist = tl.where(bins < 256, hist, 0)
            at_least = tl.cumsum(hist, 0, reverse=True)  # eligible tokens whose byte is >= i
            b = tl.max(tl.where(at_least >= want, bins, -1), 0)
            want = want - tl.sum(tl.where(bins > b, hist, 0), 0)
            prefix = prefix * 256 + b
        return _from_order_key(prefix - 0x80000000)

    @triton.jit
    def _compact(base, V, div, thr, cand_z, cand_i, BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr):
        """Write the tokens with z >= thr, in token order, to cand_z / cand_i (at most BLOCK_C of
        them); returns how many there are (which may exceed BLOCK_C)."""
        lanes = tl.arange(0, BLOCK_V)
        n = tl.sum(lanes * 0, 0)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + lanes
            z = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) / div + 0.0
            keep = (offs < V) & (z >= thr)
            at = n + tl.cumsum(keep.to(tl.int32), 0) - 1
            tl.store(cand_z + at, z, mask=keep & (at < BLOCK_C))
            tl.store(cand_i + at, offs, mask=keep & (at < BLOCK_C))
            n += tl.sum(keep.to(tl.int32), 0)
        return n

    @triton.jit
    def _tile_top_p(z, live, thr, zmax, top_p, SEARCH_STEPS: tl.constexpr):
        """_bisect over candidates held in registers (all have z >= thr)."""
        mass = tl.where(live, tl.exp(z - zmax), 0.0)
        target = top_p * tl.sum(mass, 0)
        keys = _order_key(z)
        lo = _order_key(thr)
        hi = _order_key(zmax) + 1
        for _ in range(SEARCH_STEPS):
            mid = lo + (hi - lo) // 2
            enough = tl.sum(tl.where(keys >= mid, mass, 0.0), 0) >= target
            lo = tl.where(enough, mid, lo)
            hi = tl.where(enough, hi, mid)
        return _from_order_key(lo)

    @triton.jit
    def _pick(z, tokens, keep, seed, index, V):
        """argmax of z + Gumbel noise over the kept tokens; the first token on a tie."""
        score = tl.where(keep, z + _philox_gumbel(seed, index, tokens), float("-inf"))
        top = tl.max(score, 0)
        return tl.min(tl.where(score == top, tokens, V), 0)

    @triton.jit
    def _kth_key(u, k):
        """The k-th largest (ties counted) of u, unsigned 32-bit order keys held as int64 in
        registers (0 for lanes out of the race): a radix select, one byte per step."""
        bins = tl.arange(0, 512)                      # bin 256 takes the lanes out of the race
        prefix = tl.sum(u * 0, 0)
        want = k
        for d in tl.static_range(4):
            eligible = (u >> (32 - 8 * d)) == prefix
            hist = tl.histogram(tl.where(eligible, ((u >> (24 - 8 * d)) & 0xFF).to(tl.int32), 256), 512)
            hist = tl.where(bins < 256, hist, 0)
            at_least = tl.cumsum(hist, 0, reverse=True)
            b = tl.max(tl.where(at_least >= want, bins, -1), 0)
            want = want - tl.sum(tl.where(bins > b, hist, 0), 0)
            prefix = prefix * 256 + b
        return prefix

    @triton.jit
    def _select_row(base, V, div, top_k, top_p, log_min_p, zmax, seed, index, cand_z, cand_i,
                    BLOCK_V: tl.constexpr, SEARCH_STEPS: tl.constexpr, BLOCK_C: tl.constexpr):
        """The token of one row (temperature > 0) by passes over it: top-k's k-th value by radix
        select, min-p, then, when at most BLOCK_C tokens are left, top-p and the draw over them in
        registers (gathered once into cand_z / cand_i), else top-p by bisection and a draw pass."""
        lanes = tl.arange(0, BLOCK_V)
        thr = zmax - float("inf")                  # -inf, as a loop-safe f32 scalar
        if (top_k > 0) & (top_k < V):
            thr = _radix_kth(base, V, div, top_k, BLOCK_V)
        thr = tl.maximum(thr, zmax + log_min_p)
        n_cand = V + 1
        if (top_p < 1.0) & (thr > float("-inf")):
            n_cand = _compact(base, V, div, thr, cand_z, cand_i, BLOCK_C, BLOCK_V)
            tl.debug_barrier()                     # other warps read what this pass wrote
        if n_cand <= BLOCK_C:
            c = tl.arange(0, BLOCK_C)
            live = c < n_cand
            z = tl.load(cand_z + c, mask=live, other=float("-inf"))
            ids = tl.load(cand_i + c, mask=live, other=0)
            thr = tl.maximum(thr, _tile_top_p(z, live, thr, zmax, top_p, SEARCH_STEPS))
            token = _pick(z, ids, live & (z >= thr), seed, index, V)
        else:
            if top_p < 1.0:
                tot = tl.zeros([BLOCK_V], tl.float32)
                for v0 in range(0, V, BLOCK_V):
                    offs = v0 + lanes
                    z = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) / div + 0.0
                    tot += tl.where(z >= thr, tl.exp(z - zmax), 0.0)
                target = top_p * tl.sum(tot, 0)
                thr = tl.maximum(thr, _bisect(base, V, div, zmax, _order_key(thr), _order_key(zmax) + 1,
                                              target, BLOCK_V, SEARCH_STEPS))
            best = tl.full([BLOCK_V], float("-inf"), tl.float32)
            best_at = tl.full([BLOCK_V], 0, tl.int32)
            for v0 in range(0, V, BLOCK_V):
                offs = v0 + lanes
                ok = offs < V
                z = tl.load(base + offs, mask=ok, other=float("-inf")).to(tl.float32) / div + 0.0
                score = tl.where(ok & (z >= thr), z + _philox_gumbel(seed, index, offs), float("-inf"))
                better = score > best
                best_at = tl.where(better, offs, best_at)
                best = tl.where(better, score, best)
            top = tl.max(best, 0)
            token = tl.min(tl.where(best == top, best_at, V), 0)
        return token
