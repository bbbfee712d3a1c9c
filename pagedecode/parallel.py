"""Tensor parallelism, as users start it (the machinery is in pagedecode/model/parallel.py).

Started by the engine (the usual way: no distributed code at all):

    engine = pd.Engine.from_pretrained(path, tensor_parallel_size=2)
    ...
    engine.close()

Joined from torchrun (`torchrun --nproc-per-node 2 script.py`), every rank runs:

    engine = pagedecode.parallel.from_torchrun(path)     # rank 0: the Engine; other ranks: None,
    if engine is not None:                               # after serving the steps until rank 0
        ...                                              # closes the engine
        engine.close()
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .model.parallel import ModelUnavailableError, TensorParallelModel, load_tensor_parallel, serve_rank

__all__ = ["ModelUnavailableError", "TensorParallelModel", "from_torchrun", "serve_rank"]


def from_torchrun(path: str | Path, device: str = "cpu", dtype: Any = None, **engine_options: Any) -> Any:
    """Join the group torchrun set up (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the
    environment): rank 0 returns an Engine, the others serve its steps and return None."""
    from .runtime.config import EngineConfig
    from .runtime.engine import Engine
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if device == "cuda":
        torch.cuda.set_device(rank)
    if rank != 0:
        serve_rank(path, rank=rank, world=world, device=torch.device(device if device == "cpu" else f"cuda:{rank}"),
                   dtype=dtype)
        return None
    config = EngineConfig(**{"model_name": str(path), **engine_options})
    tp, tokenizer = load_tensor_parallel(path, world, device=device, dtype=dtype,
                                         attention_backend=config.attention_backend, joined=True)
    return Engine(tp, tokenizer, config)
