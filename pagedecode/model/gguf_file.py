"""Load a GGUF file (llama.cpp's format): hyperparameters, weights and tokenizer from one file.

Read with model/gguf_reader.py (every count bounded by the file's size; the tensor types named
as the `gguf` package names them). Tensor types: F32, F16, BF16 as float tensors; Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K kept in their blocks as the file stores them (model/quant.py,
kernels/quant_types.py); any other type fails to load naming it. Each tensor's shape is checked
against the configuration, and its bytes against its shape and type, before anything is copied.

llama.cpp's converters reorder the rows of every head of q_proj / k_proj for the "llama"
architecture, so that its RoPE rotates adjacent pairs (0, 1), (2, 3), ...; pagedecode rotates
dimension i with i + head_dim / 2 (Hugging Face's layout). Loading undoes that reordering.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ModelLoadError
from .config import ModelConfig
from ..kernels.quant_types import BLOCK_TYPES
from .gguf_reader import GGUFContents, read_file
from .quant import QuantizedWeight, Weight
from .shapes import Declared, check_shape, check_weights

GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
               "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}
PERMUTED_ARCHITECTURES = ("llama", "mistral")
FLOAT_BYTES = {"F32": 4, "F16": 2, "BF16": 2}
NATIVE_TYPES = (*FLOAT_BYTES, *(k.upper() for k in BLOCK_TYPES))
ROPE_FACTORS_MOST = 1 << 11                          # half the largest head_dim ModelConfig accepts


def is_gguf(path: str | Path) -> bool:
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def read_contents(path: Path) -> GGUFContents:
    """The file's metadata and tensor table (model/gguf_reader.py), every count bounded by its size."""
    return read_file(path)


def read_metadata(path: Path) -> dict[str, Any]:
    """Every metadata key-value of a GGUF file, as Python values (numeric arrays as numpy arrays)."""
    return read_contents(path).metadata


def hf_name(name: str) -> str | None:
    """The Hugging Face tensor name for a GGUF one (blk.3.attn_q.weight -> model.layers.3.
    self_attn.q_proj.weight); None for tensors the forward does not use (rope_freqs, ...)."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def tensor_nbytes(name: str, kind: str, shape: tuple[int, ...]) -> int:
    """The bytes a tensor of this type and (rows, ..., columns) shape takes; ModelLoadError for a
    type pagedecode does not load or a row that is not whole blocks."""
    if kind in FLOAT_BYTES:
        return int(np.prod(shape)) * FLOAT_BYTES[kind]
    if kind.lower() not in BLOCK_TYPES:
        raise ModelLoadError(f"tensor {name} has type {kind}, which pagedecode cannot load "
                             f"(supported: {', '.join(NATIVE_TYPES)})")
    block, type_size = BLOCK_TYPES[kind.lower()]
    if shape[-1] % block:
        raise ModelLoadError(f"tensor {name}: rows of {shape[-1]} inputs are not whole {kind} blocks of {block}")
    return int(np.prod(shape[:-1])) * (shape[-1] // block) * type_size


def read_tensor(t: Any) -> Weight:
    """One ReaderTensor as a float tensor or QuantizedWeight, in torch's (rows, columns) order; its
    bytes checked against its shape and type. A view of the file's mapping, not a copy: the model
    copies each weight once, where it stacks or owns it (LlamaModel), and the mapping goes with
    the last view."""
    kind = t.tensor_type.name
    shape = tuple(int(n) for n in reversed(t.shape))     # GGUF lists the fastest dimension first
    data = np.asarray(t.data)
    expected = tensor_nbytes(t.name, kind, shape)
    if data.nbytes != expected:
        raise ModelLoadError(f"tensor {t.name}: {data.nbytes} bytes in the file, but a {kind} tensor of shape "
                             f"{shape} takes {expected}")
    if kind == "F32":
        return torch.from_numpy(data.astype(np.float32, copy=False).reshape(shape))
    if kind == "F16":
        return torch.from_numpy(data.astype(np.float16, copy=False).reshape(shape))
    if kind == "BF16":
        return torch.from_numpy(data.view(np.int16).reshape(shape)).view(torch.bfloat16)
    if len(shape) != 2:
        raise ModelLoadError(f"tensor {t.name}: a {kind} tensor of shape {shape}; pagedecode keeps blocks for matrices only")
    blocks = torch.from_numpy(data.view(np.uint8).reshape(shape[0], -1))
    return QuantizedWeight(kind.lower(), blocks, (shape[0], shape[1]))


def _unpermute(w: Weight, n_head: int) -> Weight:
    """Undo llama.cpp's q/k row order. Within a head of d rows, GGUF row 2i + j (pair i, member
    j) holds Hugging Face row j * d/2 + i; so HF row (j, i) takes GGUF row 2i + j."""
    rows = w.shape[0]
    index = torch.arange(rows).view(n_head, rows // n_head // 2, 2).transpose(1, 2).reshape(-1)
    if isinstance(w, QuantizedWeight):
        return w.select_rows(index)
    assert isinstance(w, torch.Tensor)             # a file's tensors are never stacks
    return w[index].contiguous()


def read_gguf(path: Path) -> tuple[ModelConfig, dict[str, Weight], dict[str, Any]]:
    """(config, weights under Hugging Face names, metadata) of a GGUF file."""
    contents = read_contents(path)
    meta, tensors = contents.metadata, contents.tensors
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path}: no token_embd.weight tensor")
    rope_factors = None
    if "rope_freqs.weight" in tensors:
        factors = tensors["rope_freqs.weight"].data
        if factors.size > ROPE_FACTORS_MOST:           # one per frequency: head_dim / 2 of them
            raise ModelLoadError(f"{path}: rope_freqs.weight holds {factors.size} values, more than any head_dim has")
        rope_factors = np.array(factors, dtype=np.float64).tolist()
    embedding_shape = tensors["token_embd.weight"].shape
    if len(embedding_shape) != 2:
        raise ModelLoadError(f"{path}: token_embd.weight has shape {list(embedding_shape)}, not (hidden, vocab)")
    config = ModelConfig.from_gguf(meta, vocab_size=int(embedding_shape[1]), rope_factors=rope_factors)
    if rope_factors is not None:
        check_shape("rope_freqs.weight", (config.head_dim // 2,), (len(rope_factors),))
    # shapes checked from the table, before any data is read (the un-permute reads them as given too)
    targets = {name: target for name, target in ((n, hf_name(n)) for n in tensors) if target is not None}
    check_weights(config, {target: Declared(tuple(reversed(tensors[name].shape))) for name, target in targets.items()},
                  path)
    weights: dict[str, Weight] = {target: read_tensor(tensors[name]) for name, target in targets.items()}
    if meta.get("general.architecture") in PERMUTED_ARCHITECTURES:
        for i in range(config.num_layers):
            for proj, heads in (("q_proj", config.num_heads), ("k_proj", config.num_kv_heads)):
                for kind in ("weight", "bias"):
                    key = f"model.layers.{i}.self_attn.{proj}.{kind}"
                    if key in weights:
                        weights[key] = _unpermute(weights[key], heads)
    config.tie_word_embeddings = "lm_head.weight" not in weights
    kinds = {t.tensor_type.name for t in tensors.values()}
    config.dtype = "float32" if kinds <= {"F32"} else "float16" if "F16" in kinds and "BF16" not in kinds else "bfloat16"
    return config, weights, meta


def chat_template(path: Path) -> tuple[str | None, dict[str, Any]]:
    """(tokenizer.chat_template or None, the special tokens' strings) of a GGUF file."""
    meta = read_metadata(path)
    tokens = meta.get("tokenizer.ggml.tokens") or []
    specials: dict[str, Any] = {}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        specials[name] = str(tokens[i]) if i is not None and 0 <= int(i) < len(tokens) else None
    source = meta.get("tokenizer.chat_template")
    return (str(source) if source else None), specials
