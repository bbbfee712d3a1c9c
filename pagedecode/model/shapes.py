"""What shape each tensor must have under a ModelConfig, checked at load for every format.

A checkpoint whose metadata disagrees with its tensors (a head count, a head_dim, a truncated
projection) would otherwise reach the forward, where the compiled CPU pass indexes by the
configuration: out of bounds. Refused here instead, in one line naming the tensor, the shape the
configuration needs and the shape found. Names are Hugging Face's (model.layers.N.self_attn.
q_proj.weight), which the GGUF loader maps its tensors to; shapes are torch's (rows, columns).
"""
from __future__ import annotations

from typing import Iterator, Mapping, NamedTuple, Protocol, Sequence

from ..errors import ModelLoadError
from .config import ModelConfig

LAYER_PREFIX = "model.layers."


class Shaped(Protocol):
    """A tensor, a QuantizedWeight (its logical shape), or a shape a file declares (Declared)."""
    @property
    def shape(self) -> Sequence[int]: ...


class Declared(NamedTuple):
    """A tensor's shape as a file's table gives it, checked before its data is read."""
    shape: tuple[int, ...]


def check_shape(name: str, expected: Sequence[int], found: Sequence[int]) -> None:
    """The one shape check: every tensor type (float, quantized blocks) gives its logical shape."""
    if tuple(int(n) for n in found) != tuple(expected):
        raise ModelLoadError(f"tensor {name} has shape {list(found)}, but the model's configuration needs "
                             f"{list(expected)}: its metadata disagrees with its tensors")


def expected_shapes(c: ModelConfig, layer: int | None = None) -> Iterator[tuple[str, tuple[int, ...], bool]]:
    """(name, shape, required) of the global tensors (layer None) or of one layer's."""
    h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    if layer is None:
        yield "model.embed_tokens.weight", (c.vocab_size, h), True
        yield "model.norm.weight", (h,), True
        yield "lm_head.weight", (c.vocab_size, h), False         # absent: tied to the embedding
        return
    p = f"{LAYER_PREFIX}{layer}."
    for name, shape in (("input_layernorm.weight", (h,)), ("post_attention_layernorm.weight", (h,)),
                        ("self_attn.q_proj.weight", (q, h)), ("self_attn.k_proj.weight", (kv, h)),
                        ("self_attn.v_proj.weight", (kv, h)), ("self_attn.o_proj.weight", (h, q)),
                        ("mlp.gate_proj.weight", (c.intermediate_size, h)),
                        ("mlp.up_proj.weight", (c.intermediate_size, h)),
                        ("mlp.down_proj.weight", (h, c.intermediate_size))):
        yield p + name, shape, True
    for name, shape in (("self_attn.q_proj.bias", (q,)), ("self_attn.k_proj.bias", (kv,)),
                        ("self_attn.v_proj.bias", (kv,)), ("self_attn.o_proj.bias", (h,))):
        yield p + name, shape, False
    yield p + "self_attn.q_norm.weight", (c.head_dim,), c.qk_norm
    yield p + "self_attn.k_norm.weight", (c.head_dim,), c.qk_norm


def check_weights(config: ModelConfig, weights: Mapping[str, Shaped], source: object) -> None:
    """Every tensor the forward reads is present with the shape `config` gives it; else one
    ModelLoadError naming it. The layer count is checked against the layers the checkpoint holds
    first, so a hostile count (2^31) costs nothing."""
    present = {int(parts[2]) for parts in (n.split(".", 3) for n in weights)
               if len(parts) > 3 and f"{parts[0]}.{parts[1]}." == LAYER_PREFIX and parts[2].isdigit()}
    if config.num_layers > len(present):
        first_missing = next(i for i in range(config.num_layers) if i not in present)
        raise ModelLoadError(f"{source}: the configuration has {config.num_layers} layers, but the checkpoint holds "
                             f"{len(present)} (none for layer {first_missing})")
    for layer in (None, *range(config.num_layers)):
        for name, shape, required in expected_shapes(config, layer):
            w = weights.get(name)
            if w is None:
                if required:
                    raise ModelLoadError(f"{source}: checkpoint has no tensor {name!r}")
                continue
            check_shape(name, shape, tuple(w.shape))
