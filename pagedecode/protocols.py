"""The interfaces the runtime relies on, as typing Protocols, so test doubles and real objects
are checked alike (by mypy, and by isinstance at construction)."""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .model.batch import ForwardBatch
from .model.kv_cache import KVCache
from .model.tokenizer import BytePieces, TokenizerLike


class ModelShape(Protocol):
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_context: int
    model_type: str
    eos_token_ids: tuple[int, ...]


@runtime_checkable
class Model(Protocol):
    """A model the engine can run: its shape, where it lives, and one forward over a batch.
    forward returns float logits (N, vocab), one row per sequence whose chunk reaches its last
    known token (ForwardBatch.logits_indices), and writes the batch's K/V into the cache."""
    device: torch.device
    dtype: torch.dtype

    @property
    def config(self) -> ModelShape: ...     # pd.ModelConfig, or a test double's config

    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor: ...


__all__ = ["BytePieces", "Model", "ModelShape", "TokenizerLike"]
