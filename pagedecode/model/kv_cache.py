"""The KV cache tensors: one pool of pages per layer, addressed by slot (see kernels.kv_write).

An 8-bit cache (int8 / float8_e4m3fn: kernels/kv_quant.py) keeps a bfloat16 scale per token and KV
head beside the pages, k_scale / v_scale, in the same paged layout (slot-addressed like the rows)."""
from __future__ import annotations

import math
import mmap

import torch

from ..kernels.kv_quant import SCALE_DTYPE, is_quantized


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor. On CPU over an anonymous private mapping: the kernel's zero pages, each made
    resident when first written, so the cache holds memory for the pages requests have used, up to
    its size (torch.zeros wrote every byte at start: SmolLM2's 128 MiB resident before any request,
    and ~0.1-0.4 s of a load)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=dtype).view(shape)          # the tensor keeps the mapping


class KVCache:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self.k = zeros(shape, dtype, device)
        self.v = zeros(shape, dtype, device)
        self.page_size = page_size
        self.num_pages = num_pages
        # an 8-bit cache's scales, (layers, pages, page_size, kv_heads, 1): one per row of head_dim
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        if is_quantized(dtype):
            self.k_scale = torch.zeros((*shape[:-1], 1), dtype=SCALE_DTYPE, device=device)
            self.v_scale = torch.zeros((*shape[:-1], 1), dtype=SCALE_DTYPE, device=device)

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    def scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Layer `layer`'s (k_scale, v_scale), each (pages, page_size, kv_heads, 1); (None, None)
        for a float cache."""
        if self.k_scale is None or self.v_scale is None:
            return None, None
        return self.k_scale[layer], self.v_scale[layer]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """2 (K and V) x layers x kv_heads x (head_dim x element size, plus an 8-bit cache's
        bfloat16 scale)."""
        row = head_dim * torch.empty((), dtype=dtype).element_size()
        if is_quantized(dtype):
            row += torch.empty((), dtype=SCALE_DTYPE).element_size()
        return 2 * num_layers * num_kv_heads * row
