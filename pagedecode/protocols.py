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


class ModelParts:
    """The optional parts of a Model the engine reads, each declared here with what a model that
    lacks it is taken to have (pagedecode's own models have them all; a test double needs none).
    The engine reads them only through this view of its model."""

    def __init__(self, model: Model) -> None:
        self.model = model

    @property
    def world(self) -> int:
        """Tensor-parallel ranks the model runs on (its KV cache is per rank). Default 1."""
        return int(getattr(self.model, "world", 1))

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights take in memory as the forward holds them (this rank's). Default 0:
        the model does not say."""
        return int(getattr(self.model, "weight_bytes", 0))

    @property
    def failure(self) -> str | None:
        """Why the model can serve no more requests (a lost tensor-parallel rank). Default None."""
        failure: str | None = getattr(self.model, "failure", None)
        return failure

    def close(self) -> None:
        """Stop what the model runs beside the engine (worker processes). Default: nothing."""
        close = getattr(self.model, "close", None)
        if callable(close):
            close()

    @property
    def takes_attention_backend(self) -> bool:
        """Whether the model has an `attention_backend` ("auto" | "triton" | "torch") to set.
        Default: no."""
        return hasattr(self.model, "attention_backend")

    def set_attention_backend(self, backend: str) -> None:
        setattr(self.model, "attention_backend", backend)

    @property
    def takes_deterministic(self) -> bool:
        """Whether the model has a batch-invariant forward, switched by a `deterministic`
        attribute. Default: no (deterministic=True is refused)."""
        return hasattr(self.model, "deterministic")

    def set_deterministic(self, on: bool) -> None:
        setattr(self.model, "deterministic", on)

    def configure_cpu(self, matmul: str, pack_weights: bool) -> None:
        """The compiled CPU forward's matmul and packed weights (EngineConfig.cpu_*). Default: nothing."""
        configure = getattr(self.model, "configure_cpu", None)
        if callable(configure):
            configure(matmul, pack_weights)

    def uses_cpu_extension(self) -> bool:
        """Whether forward runs the compiled CPU pass (pagedecode._cpu). Default False."""
        uses = getattr(self.model, "uses_cpu_extension", None)
        return bool(uses()) if callable(uses) else False


__all__ = ["BytePieces", "Model", "ModelParts", "ModelShape", "TokenizerLike"]
