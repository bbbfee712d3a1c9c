"""Rotary position embedding, "rotate half" convention (HF Llama), with Llama 3 / linear scaling."""
from __future__ import annotations

import math
from typing import Mapping

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: Mapping | None = None) -> torch.Tensor:
    """Inverse frequencies (head_dim // 2,) in float32, after the checkpoint's rope scaling."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).double() / head_dim))
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        pass
    elif kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "freq_factors":     # a GGUF's rope_freqs tensor: one divisor per frequency
        inv = inv / torch.as_tensor(scaling["factors"], dtype=torch.float64)
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
        raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3, freq_factors)")
    return inv.float()


def rope_cos_sin(inv_freq: torch.Tensor, max_positions: int, attention_factor: float = 1.0):
    """Tables (max_positions, head_dim) in float32: cos, and sin with the first half negated,
    so that rotate_half(x) * sin == roll(x, head_dim / 2) * signed_sin (see apply_rope)."""
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)                      # (P, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)               # (P, D), halves repeated as HF lays them out
    sin = emb.sin() * attention_factor
    half = inv_freq.shape[0]
    return emb.cos() * attention_factor, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: (T, H, D); cos, signed_sin: (T, D) at each token's position. Equals HF's
    x * cos + rotate_half(x) * sin, with rotate_half(x) = (-x2, x1) = roll(x, D/2) * (-1, 1)."""
    rolled = torch.roll(x, x.shape[-1] // 2, dims=-1)
    return x * cos[:, None, :] + rolled * signed_sin[:, None, :]
