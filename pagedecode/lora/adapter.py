"""A PEFT LoRA adapter read from its folder and checked against the model it is to run on.

PEFT saves adapter_config.json (r, lora_alpha, use_rslora, target_modules, ...) and
adapter_model.safetensors, whose tensors are named after the wrapped model's modules:

    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight   A (r, in)
    base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight   B (out, r)

and a projection W becomes W + scaling * B A, scaling = lora_alpha / r (lora_alpha / sqrt(r) with
use_rslora). Every way an adapter can disagree with the model -- a module the layers lack, a
shape, a rank above max_lora_rank, a layer past the last, a feature this runtime does not apply
(DoRA, trained biases, per-module alphas) -- is one AdapterError naming the adapter and the problem.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ..errors import AdapterError
from ..model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# the projections an adapter may target, by PEFT's module names, and the block each sits in
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
         "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
TENSOR_NAME = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


def projection_shapes(c: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection of a layer under the model's configuration."""
    h, q, kv, inter = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}


class LoRAWeights(NamedTuple):
    a: torch.Tensor          # (r, in) float32
    b: torch.Tensor          # (out, r) float32
    scaling: float


@dataclass(eq=False)
class LoRAAdapter:
    """A loaded adapter: its weights per (layer, projection), on the host in float32."""
    name: str
    path: Path
    digest: str                                  # sha256 of its config and weight files
    rank: int                                    # the largest rank of any of its modules
    weights: dict[tuple[int, str], LoRAWeights] = field(repr=False)

    @property
    def key(self) -> tuple[str, str]:
        """Its identity in the engine: a name reloaded with other weights is another adapter."""
        return self.name, self.digest

    @property
    def projections(self) -> frozenset[str]:
        return frozenset(p for _, p in self.weights)


def _fail(name: str, problem: str) -> AdapterError:
    return AdapterError(f"LoRA adapter {name!r}: {problem}")


def read_config(name: str, folder: Path) -> dict[str, Any]:
    try:
        raw = (folder / CONFIG_FILE).read_bytes()
        config = json.loads(raw)
    except FileNotFoundError:
        raise _fail(name, f"no {CONFIG_FILE} in {folder}") from None
    except (OSError, ValueError) as e:
        raise _fail(name, f"cannot read {folder / CONFIG_FILE}: {e}") from None
    if not isinstance(config, dict):
        raise _fail(name, f"{CONFIG_FILE} is not a JSON object")
    return config


def _scaling_rule(name: str, config: dict[str, Any]) -> tuple[float, bool]:
    """(lora_alpha, use_rslora), after refusing what this runtime does not apply."""
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise _fail(name, f"peft_type {peft_type} is not LoRA")
    for flag, what in (("use_dora", "DoRA (use_dora)"), ("modules_to_save", "modules_to_save (fully trained "
                                                                            "modules)")):
        if config.get(flag):
            raise _fail(name, f"{what} is not supported: only the low-rank deltas of q/k/v/o/gate/up/down are applied")
    if config.get("bias", "none") not in ("none", None):
        raise _fail(name, f"bias={config['bias']!r}: trained biases are not supported (bias='none' only)")
    if config.get("alpha_pattern"):
        raise _fail(name, "alpha_pattern (a per-module lora_alpha) is not supported")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise _fail(name, f"lora_alpha must be a positive number, got {alpha!r}")
    return float(alpha), bool(config.get("use_rslora", False))


def _check_targets(name: str, config: dict[str, Any]) -> None:
    """target_modules given as a list names modules; each must be one of the seven. (A regex, or
    "all-linear", is checked through the tensors the file holds.)"""
    targets = config.get("target_modules")
    if isinstance(targets, (list, tuple)):
        bad = [t for t in targets if t not in PROJECTIONS]
        if bad:
            raise _fail(name, f"targets module(s) {', '.join(map(str, bad))}, which this model's layers do not have "
                              f"as LoRA targets (supported: {', '.join(PROJECTIONS)})")


def load_adapter(name: str, path: str | Path, model: ModelConfig, max_rank: int) -> LoRAAdapter:
    """The adapter in folder `path`, checked against `model`'s shapes and max_rank (AdapterError)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(path)
    if not folder.is_dir():
        raise _fail(name, f"{folder} is not a folder (PEFT saves {CONFIG_FILE} and {WEIGHTS_FILE} in one)")
    config = read_config(name, folder)
    alpha, rslora = _scaling_rule(name, config)
    _check_targets(name, config)
    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        raise _fail(name, f"no {WEIGHTS_FILE} in {folder} (only safetensors weights are read)")
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError) as e:
        raise _fail(name, f"cannot read {weights_path}: {e}") from None
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tname, t in tensors.items():
        m = TENSOR_NAME.match(tname)
        if m is None or m.group(3) not in PROJECTIONS or BLOCK[m.group(3)] != m.group(2):
            raise _fail(name, f"tensor {tname} is not the LoRA A or B of a layer's "
                              f"{'/'.join(p.removesuffix('_proj') for p in PROJECTIONS)} projection: this model's "
                              "adapters may target only those")
        pairs.setdefault((int(m.group(1)), m.group(3)), {})[m.group(4)] = t
    if not pairs:
        raise _fail(name, f"{weights_path} holds no LoRA weights")
    shapes = projection_shapes(model)
    out: dict[tuple[int, str], LoRAWeights] = {}
    for (layer, proj), ab in sorted(pairs.items()):
        where = f"layer {layer} {proj}"
        if layer >= model.num_layers:
            raise _fail(name, f"{where}: the model has {model.num_layers} layers")
        if set(ab) != {"A", "B"}:
            raise _fail(name, f"{where}: lora_{'B' if 'A' in ab else 'A'} is missing")
        a, b = ab["A"], ab["B"]
        n_out, n_in = shapes[proj]
        r = a.shape[0] if a.dim() == 2 else -1
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != n_in or b.shape != (n_out, r):
            raise _fail(name, f"{where}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit the model "
                              f"(expected A (r, {n_in}) and B ({n_out}, r))")
        if not 1 <= r <= max_rank:
            raise _fail(name, f"{where}: rank {r} is above max_lora_rank {max_rank}")
        if not (a.is_floating_point() and b.is_floating_point()):
            raise _fail(name, f"{where}: weights must be floating point, got {a.dtype}")
        scaling = alpha / (math.sqrt(r) if rslora else r)
        out[(layer, proj)] = LoRAWeights(a.float().contiguous(), b.float().contiguous(), scaling)
    if not all(bool(torch.isfinite(w.a).all() and torch.isfinite(w.b).all()) for w in out.values()):
        raise _fail(name, "its weights hold NaN or infinite values")
    digest = hashlib.sha256((folder / CONFIG_FILE).read_bytes())
    digest.update(weights_path.read_bytes())
    return LoRAAdapter(name, folder, digest.hexdigest(), max(w.a.shape[0] for w in out.values()), out)
