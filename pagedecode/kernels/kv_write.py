"""Write new keys and values into the paged cache at the slots the runtime assigned.

Layout: k_cache, v_cache are (num_pages, page_size, kv_heads, head_dim); a slot is
page * page_size + offset within the page. A slot of -1 means "padding: write nothing".
"""
from __future__ import annotations


from ._backend import HAS_TRITON, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl


def write_kv_ref(k_cache, v_cache, k, v, slot_mapping) -> None:
    """k, v: (T, kv_heads, head_dim); slot_mapping: (T,) int. Writes in place."""
    slots = slot_mapping.long()
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    # slot = page * page_size + offset is the row of the cache seen as (pages * page_size, H, D)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


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


def write_kv_triton(k_cache, v_cache, k, v, slot_mapping) -> None:
    T, H, D = k.shape
    if T == 0:
        return
    assert k_cache.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride()
    _write_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        PAGE_SIZE=k_cache.shape[1], HEADS=H, HEAD_DIM=D,
        BLOCK_H=triton.next_power_of_2(H), BLOCK_D=triton.next_power_of_2(D))


def write_kv(k_cache, v_cache, k, v, slot_mapping, backend: str = "auto") -> None:
    """Write k, v (T, kv_heads, head_dim) to the slots in slot_mapping (T,); -1 skips a row."""
    if use_triton(k, backend):
        write_kv_triton(k_cache, v_cache, k, v, slot_mapping)
    else:
        write_kv_ref(k_cache, v_cache, k, v, slot_mapping)
