"""Rotary position embedding, "rotate half" convention (HF Llama), with Llama 3 / linear scaling."""
from __future__ import annotations

import math
from typing import Mapping

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: Mapping | None = None) -> torch.Tensor:
    """Inverse frequencies (head_dim // 2,) in float32, after the checkpoint's rope scaling."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).double() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in (None, "default"):
        pass
    elif kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        # long wavelengths are slowed by `factor`, short ones kept, the band between blended
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(mid, blended, scaled)
    else:
        raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")
    return inv.float()


def rope_cos_sin(inv_freq: torch.Tensor, max_positions: int, attention_factor: float = 1.0):
    """cos, sin tables (max_positions, head_dim) in float32, halves repeated as HF lays them out."""
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)                      # (P, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)               # (P, D)
    return emb.cos() * attention_factor, emb.sin() * attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, H, D); cos, sin: (T, D) already gathered at each token's position."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)
