"""RMSNorm. The default path is torch's (on the GPU its fused ops are already close to
bandwidth); deterministic mode on CUDA takes the Triton kernel: one row per program, the whole
row in one tile, so a row's sum of squares is reduced in the same order whatever the row count
(torch's CUDA reductions may split a row over several blocks when there are few rows)."""
import torch
import torch.nn.functional as F

from ._backend import HAS_TRITON, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: (..., H), weight: (H,). Computed in float32, returned in x's dtype (as HF Llama does)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)     # one fused op: the same formula
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


if HAS_TRITON:
    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, H, eps, BLOCK_H: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, BLOCK_H)
        ok = h < H
        x = tl.load(x_ptr + row * stride_x + h, mask=ok, other=0.0).to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, 0) / H + eps)
        # as the reference: the normalised row rounded to x's dtype, then times the weight
        y = (x * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + h, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + h, (w * y).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    H = x.shape[-1]
    assert weight.shape == (H,) and weight.stride(0) == 1
    x2 = x.reshape(-1, H)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], H), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block_h = triton.next_power_of_2(H)
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, x2.stride(0), out.stride(0), H, eps, BLOCK_H=block_h,
                                          num_warps=min(16, max(1, block_h // 256)))
    return out.view(x.shape)


def rms_norm_deterministic(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "auto") -> torch.Tensor:
    """rms_norm with one row per program on CUDA (or where backend="triton" asks); the reference
    elsewhere."""
    if use_triton(x, backend):
        return rms_norm_triton(x, weight, eps)
    return rms_norm(x, weight, eps)
