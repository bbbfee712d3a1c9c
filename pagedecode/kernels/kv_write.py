"""Write new keys and values into the paged cache at the slots the runtime assigned.

Layout: k_cache, v_cache are (num_pages, page_size, kv_heads, head_dim); a slot is
page * page_size + offset within the page. A slot of -1 means "padding: write nothing".

An 8-bit cache (kernels/kv_quant.py) comes with k_scale, v_scale (num_pages, page_size, kv_heads, 1)
bfloat16: each row is quantized as it is written, its scale stored at the same slot.
"""
from __future__ import annotations

import torch

from ._backend import HAS_TRITON, use_triton
from .kv_quant import FP8_STEPS, QMAX, quantize_rows

if HAS_TRITON:
    import triton
    import triton.language as tl


def write_kv_ref(k_cache, v_cache, k, v, slot_mapping, k_scale=None, v_scale=None) -> None:
    """k, v: (T, kv_heads, head_dim); slot_mapping: (T,) int. Writes in place."""
    slots = slot_mapping.long()
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    # slot = page * page_size + offset is the row of the cache seen as (pages * page_size, H, D)
    for cache, scale, x in ((k_cache, k_scale, k), (v_cache, v_scale, v)):
        if scale is None:
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, x.to(cache.dtype))
            continue
        q, s = quantize_rows(x, cache.dtype)
        # index_copy_ has no 8-bit float kernel on CPU: the rows go in through their bytes
        cache.view(torch.uint8).view(-1, *cache.shape[2:]).index_copy_(0, slots, q.view(torch.uint8))
        scale.view(-1, *scale.shape[2:]).index_copy_(0, slots, s)


if HAS_TRITON:
    @triton.jit
    def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
                         stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_cp, stride_co, stride_ch,
                         PAGE_SIZE: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        # one program per token: all its heads at once
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)   # int64 before any stride product
        if slot >= 0:
            page = slot // PAGE_SIZE
            off = slot % PAGE_SIZE
            h = tl.arange(0, BLOCK_H)[:, None]
            d = tl.arange(0, BLOCK_D)[None, :]
            m = (h < HEADS) & (d < HEAD_DIM)
            dst = page * stride_cp + off * stride_co + h * stride_ch + d
            kx = tl.load(k_ptr + t.to(tl.int64) * stride_kt + h * stride_kh + d, mask=m)
            vx = tl.load(v_ptr + t.to(tl.int64) * stride_vt + h * stride_vh + d, mask=m)
            tl.store(kc_ptr + dst, kx.to(kc_ptr.dtype.element_ty), mask=m)
            tl.store(vc_ptr + dst, vx.to(vc_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _e4m3_round(y):
        """kv_quant.e4m3_round: float32 y, |y| <= 448 -> the nearest e4m3 value, as float32."""
        e = tl.maximum((y.to(tl.int32, bitcast=True) >> 23) & 0xFF, 127 - 6)
        up = ((257 - e) << 23).to(tl.float32, bitcast=True)
        step = ((e - 3) << 23).to(tl.float32, bitcast=True)
        return ((y * up + 12582912.0) - 12582912.0) * step

    @triton.jit
    def _stored_scale(s):
        """kv_quant.stored_scale: float32 s >= 0 -> the bfloat16 value stored for it (nearest even),
        as float32. In integer arithmetic on the bits, not a conversion, so that the interpreter
        (whose float conversions /work/shared/KERNELS.md distrusts) rounds as torch does; the
        store's conversion then meets an exact value."""
        b = s.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return b.to(tl.float32, bitcast=True)

    @triton.jit
    def _quantize_store(x, c_ptr, s_ptr, dst, srow, m, h_ok, QLIMIT: tl.constexpr, IS_INT: tl.constexpr,
                        FP8_STEPS: tl.constexpr):
        """x (BLOCK_H, BLOCK_D) float32 rows -> 8-bit values at c_ptr + dst, each row's scale at
        s_ptr + srow (kernels/kv_quant.py's quantize_rows: int8's one scale, fp8's best of
        FP8_STEPS)."""
        amax = tl.max(tl.where(m, tl.abs(x), 0.0), 1)                      # (BLOCK_H,)
        base = tl.math.div_rn(amax, tl.full(amax.shape, QLIMIT, tl.float32))
        if IS_INT:
            scale = _stored_scale(base)
            safe = tl.where(scale > 0, scale, 1.0)
            y = tl.math.div_rn(x, tl.broadcast_to(safe[:, None], x.shape))
            y = tl.minimum(tl.maximum(y, -QLIMIT), QLIMIT)
            y = (y + 12582912.0) - 12582912.0               # kv_quant.ROUNDER: half to even, then exact
            tl.store(c_ptr + dst, y.to(c_ptr.dtype.element_ty), mask=m)
            tl.store(s_ptr + srow, scale.to(s_ptr.dtype.element_ty), mask=h_ok)
        else:
            x64 = x.to(tl.float64)
            best_q = tl.zeros(x.shape, tl.float32)
            best_s = base
            best_e = tl.full(amax.shape, float("inf"), tl.float64)
            for j in tl.static_range(FP8_STEPS):
                s = _stored_scale(base * (1.0 + j / FP8_STEPS))
                safe = tl.where(s > 0, s, 1.0)
                q = tl.math.div_rn(x, tl.broadcast_to(safe[:, None], x.shape))
                q = _e4m3_round(tl.minimum(tl.maximum(q, -QLIMIT), QLIMIT))
                d = q.to(tl.float64) * s.to(tl.float64)[:, None] - x64
                err = tl.sum(tl.where(m, d * d, 0.0), 1)
                better = err < best_e                         # the first j on a tie, as the reference
                best_q = tl.where(better[:, None], q, best_q)
                best_s = tl.where(better, s, best_s)
                best_e = tl.where(better, err, best_e)
            tl.store(c_ptr + dst, best_q.to(c_ptr.dtype.element_ty), mask=m)
            tl.store(s_ptr + srow, best_s.to(s_ptr.dtype.element_ty), mask=h_ok)

    @triton.jit
    def _write_kv_quant_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr,
                               stride_kt, stride_kh, stride_vt, stride_vh,
                               PAGE_SIZE: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                               BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, QLIMIT: tl.constexpr,
                               IS_INT: tl.constexpr, FP8_STEPS: tl.constexpr):
        # one program per token, all its heads; the caches are contiguous, so slot s's head h
        # starts at (s * HEADS + h) * HEAD_DIM and its scale sits at s * HEADS + h
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            h = tl.arange(0, BLOCK_H)
            d = tl.arange(0, BLOCK_D)[None, :]
            h_ok = h < HEADS
            m = h_ok[:, None] & (d < HEAD_DIM)
            srow = slot * HEADS + h
            dst = srow[:, None] * HEAD_DIM + d
            kx = tl.load(k_ptr + t.to(tl.int64) * stride_kt + h[:, None] * stride_kh + d, mask=m).to(tl.float32)
            vx = tl.load(v_ptr + t.to(tl.int64) * stride_vt + h[:, None] * stride_vh + d, mask=m).to(tl.float32)
            _quantize_store(kx, kc_ptr, ks_ptr, dst, srow, m, h_ok, QLIMIT, IS_INT, FP8_STEPS)
            _quantize_store(vx, vc_ptr, vs_ptr, dst, srow, m, h_ok, QLIMIT, IS_INT, FP8_STEPS)


def write_kv_triton(k_cache, v_cache, k, v, slot_mapping, k_scale=None, v_scale=None) -> None:
    T, H, D = k.shape
    if T == 0:
        return
    if k_scale is not None:
        assert v_scale is not None and k.stride(-1) == 1 and v.stride(-1) == 1
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_scale.is_contiguous() and v_scale.is_contiguous()
        _write_kv_quant_kernel[(T,)](
            k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            PAGE_SIZE=k_cache.shape[1], HEADS=H, HEAD_DIM=D,
            BLOCK_H=triton.next_power_of_2(H), BLOCK_D=triton.next_power_of_2(D),
            QLIMIT=QMAX[k_cache.dtype], IS_INT=k_cache.dtype == torch.int8, FP8_STEPS=FP8_STEPS)
        return
    assert k_cache.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride()
    _write_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        PAGE_SIZE=k_cache.shape[1], HEADS=H, HEAD_DIM=D,
        BLOCK_H=triton.next_power_of_2(H), BLOCK_D=triton.next_power_of_2(D))


def write_kv(k_cache, v_cache, k, v, slot_mapping, backend: str = "auto", k_scale=None, v_scale=None) -> None:
    """Write k, v (T, kv_heads, head_dim) to the slots in slot_mapping (T,); -1 skips a row.
    k_scale, v_scale: an 8-bit cache's scales (each row quantized as it is written), else None."""
    if use_triton(k, backend):
        write_kv_triton(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale)
    else:
        write_kv_ref(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale)
