"""One rank's shard of a Llama model under tensor parallelism (model/parallel.py runs the ranks).

Sharding (Megatron-style, at load time; each rank reads only its slices from safetensors):
    q / k / v        column-parallel by heads (q by query heads, k and v by KV heads), re-stacked
    gate / up        column-parallel by the intermediate dimension
    o / down         row-parallel: one all_reduce each (o's bias added once, on rank 0)
    embed / lm_head  vocab-parallel: a rank holds rows [r V / N, (r + 1) V / N); the embedding
                     is an all_reduce of the rows each rank has, the logits an all_gather
    norms            replicated
Each rank's KV cache holds num_kv_heads / N heads. A shape that does not divide raises
ModelLoadError naming it.
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ModelLoadError
from .config import ModelConfig
from .llama import LlamaModel
from .shapes import Declared, check_weights


def check_divisible(c: ModelConfig, n: int) -> None:
    for name, value in (("num_attention_heads", c.num_heads), ("num_key_value_heads", c.num_kv_heads),
                        ("intermediate_size", c.intermediate_size), ("vocab_size", c.vocab_size)):
        if value % n:
            raise ModelLoadError(f"tensor_parallel_size {n} does not divide {name} = {value}")


def rank_config(c: ModelConfig, n: int) -> ModelConfig:
    """The shapes one rank computes (the engine sizes its KV cache from these)."""
    return replace(c, num_heads=c.num_heads // n, num_kv_heads=c.num_kv_heads // n,
                   intermediate_size=c.intermediate_size // n)


def load_shard(path: Path, c: ModelConfig, rank: int, n: int) -> dict[str, torch.Tensor]:
    """This rank's slices of every tensor, read slice by slice (no full copy in any process).
    Every tensor's full shape is first checked against `c` (model/shapes.py), from the files'
    headers: a checkpoint that disagrees with its config is refused before any slice is read."""
    from safetensors import safe_open
    from .loader import _read_json
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(_read_json(index)["weight_map"].values()))
    else:
        files = [p.name for p in sorted(path.glob("*.safetensors"))]
    declared: dict[str, Declared] = {}
    for name in files:
        with safe_open(str(path / name), framework="pt") as f:
            declared.update((key, Declared(tuple(f.get_slice(key).get_shape()))) for key in f.keys())
    check_weights(c, declared, path)
    D, H, Hkv, I, V = c.head_dim, c.num_heads, c.num_kv_heads, c.intermediate_size, c.vocab_size

    out: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(path / name), framework="pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                leaf = key.rsplit(".", 2)
                part = ".".join(leaf[-2:])
                if part in ("q_proj.weight", "q_proj.bias"):
                    step = H // n * D
                    out[key] = sl[rank * step:(rank + 1) * step]
                elif part in ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"):
                    step = Hkv // n * D
                    out[key] = sl[rank * step:(rank + 1) * step]
                elif part in ("gate_proj.weight", "up_proj.weight"):
                    step = I // n
                    out[key] = sl[rank * step:(rank + 1) * step]
                elif part == "o_proj.weight":
                    step = H // n * D
                    out[key] = sl[:, rank * step:(rank + 1) * step]
                elif part == "o_proj.bias":
                    out[key] = sl[:] if rank == 0 else torch.zeros(sl.get_shape())
                elif part == "down_proj.weight":
                    step = I // n
                    out[key] = sl[:, rank * step:(rank + 1) * step]
                elif key in ("model.embed_tokens.weight", "lm_head.weight"):
                    step = V // n
                    out[key] = sl[rank * step:(rank + 1) * step]
                else:
                    out[key] = sl[:]
    return out


class ShardedLlama(LlamaModel):
    """One rank's shard; the three hooks of LlamaModel become collectives."""

    def __init__(self, config: ModelConfig, rank: int, world: int, weights: dict[str, torch.Tensor],
                 device: torch.device, dtype: torch.dtype, attention_backend: str, group: Any = None) -> None:
        self.full_config = config
        self.rank, self.world, self.group = rank, world, group
        self.vocab_lo = rank * config.vocab_size // world
        self.vocab_hi = (rank + 1) * config.vocab_size // world
        super().__init__(rank_config(config, world), weights, device=device, dtype=dtype,
                         attention_backend=attention_backend)
        self.config = rank_config(config, world)
        self.comm_s = 0.0            # seconds spent in collectives (benchmarks/tp.py reports it)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        local = (ids >= self.vocab_lo) & (ids < self.vocab_hi)
        h = self.embed[(ids - self.vocab_lo).clamp(0, self.vocab_hi - self.vocab_lo - 1)]
        h = h * local[:, None].to(h.dtype)
        return self._reduce(h)

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        t = time.perf_counter()
        if self.deterministic and self.world > 2:
            # a fixed order: every rank's part gathered, then summed rank 0, 1, 2, ... (an all_reduce
            # sums in the order its algorithm picks, which may differ by chunk and by rank; with two
            # ranks a + b is the same either way)
            parts = [torch.empty_like(x) for _ in range(self.world)]
            dist.all_gather(parts, x.contiguous(), group=self.group)
            total = parts[0]
            for part in parts[1:]:
                total = total + part
            x.copy_(total)
        else:
            dist.all_reduce(x, group=self.group)
        self.comm_s += time.perf_counter() - t
        return x

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        part = LlamaModel._logits(self, h).contiguous()                                  # (N, V / world)
        parts = [torch.empty_like(part) for _ in range(self.world)]
        t = time.perf_counter()
        dist.all_gather(parts, part, group=self.group)
        self.comm_s += time.perf_counter() - t
        return torch.cat(parts, dim=-1)                                               # (N, V)
