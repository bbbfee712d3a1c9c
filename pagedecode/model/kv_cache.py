"""The KV cache tensors: one pool of pages per layer, addressed by slot (see kernels.kv_write)."""
from __future__ import annotations

from typing import Callable

import torch

_quiesce: Callable[[], None] | None
try:
    from .._cpu import quiesce as _quiesce
except ImportError:
    _quiesce = None


class KVCache:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size
        self.num_pages = num_pages
        # kept on the instance: module globals may be gone when __del__ runs at interpreter exit
        self._quiesce = _quiesce if self.k.device.type == "cpu" else None

    def __del__(self) -> None:
        # the compiled forward's decode attention runs on pool workers (csrc/paged_attention.h), one
        # of which may still be finishing an item its caller took back: the pages are freed only
        # once none is
        quiesce = getattr(self, "_quiesce", None)
        if quiesce is not None:
            quiesce()

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x element size."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
