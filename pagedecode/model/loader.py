"""Load a model: a Hugging Face directory (config, generation config, safetensors, tokenizer) or a
GGUF file (model/gguf_file.py)."""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from ..errors import ModelLoadError
from .config import ModelConfig
from .gguf_file import is_gguf, read_gguf
from .gguf_tokenizer import build_tokenizer
from .llama import LlamaModel
from .shapes import check_weights
from .tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_dtype(dtype, config: ModelConfig, device: torch.device) -> torch.dtype:
    """An explicit dtype wins; otherwise the checkpoint's on CUDA and float32 on CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is not None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]
    if device.type == "cuda":
        return DTYPES.get(config.dtype, torch.bfloat16)
    return torch.float32


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"missing file: {path}") from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors, or of the shards its index names."""
    from safetensors.torch import load_file
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(_read_json(index)["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        found = sorted(p.name for p in path.glob("*.safetensors"))
        if not found:
            raise ModelLoadError(f"no *.safetensors weights in {path} (model.safetensors or an index)")
        files = found
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        f = path / name
        if not f.is_file():
            raise ModelLoadError(f"missing weight shard: {f}")
        weights.update(load_file(str(f)))
    return weights


def load_config(path: Path) -> ModelConfig:
    cfg = _read_json(path / "config.json")
    config = ModelConfig.from_hf(cfg)
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        gen = _read_json(gen_file)
        eos = gen.get("eos_token_id")
        extra = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        config.eos_token_ids = tuple(dict.fromkeys([*extra, *config.eos_token_ids]))
        if config.bos_token_id is None:
            config.bos_token_id = gen.get("bos_token_id")
        config.check_token_ids()
    return config


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch's ops on one thread for the duration (the count before put back). A load is copies
    (stacking q, k, v; un-permuting rows; packing) that one core does at memory speed; torch's
    OpenMP pool splits each copy over its threads, which spin at a barrier for a peer that a busy
    machine has descheduled: beside a neighbour a 2-thread torch.cat of 3 MB took ~100 ms
    against ~2 ms on one thread, and SmolLM2's load spent 6.5 s of its 9 s there."""
    before = torch.get_num_threads()
    if before != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if before != 1:
            torch.set_num_threads(before)


def load_model(path, device="cpu", dtype=None, attention_backend="auto", quantization=None, tokenizer=None,
               cpu_matmul=None, cpu_pack_weights=None):
    """(LlamaModel, Tokenizer) from a Hugging Face directory or a GGUF file. `quantization`
    (model/quant.py QUANTIZATIONS: "q8_0", "q4_0", "q4_1", "q5_0", "q5_1") keeps the layer weights quantized in memory (model/quant.py); `tokenizer`,
    a folder holding tokenizer.json, replaces the model's own. The load runs on one torch thread
    (one_torch_thread)."""
    from .quant import QUANTIZATIONS
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} or None, got {quantization!r}")
    with one_torch_thread():
        return _load_model(Path(path), device, dtype, attention_backend, quantization, tokenizer, cpu_matmul,
                           cpu_pack_weights)


def _load_model(path, device, dtype, attention_backend, quantization, tokenizer, cpu_matmul, cpu_pack_weights):
    if is_gguf(path):
        config, weights, meta = read_gguf(path)
    elif path.is_dir():
        config, weights, meta = load_config(path), None, None
    elif path.is_file():
        raise ModelLoadError(f"{path} is neither a GGUF file nor a model directory")
    else:
        raise ModelLoadError(f"model directory not found: {path}")
    device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, config, device)
    if tokenizer is not None:
        tok = Tokenizer.from_dir(tokenizer, eos_token_ids=config.eos_token_ids, bos_token_id=config.bos_token_id)
    elif meta is not None:
        tok = build_tokenizer(meta)
    else:
        tok = Tokenizer.from_dir(path, eos_token_ids=config.eos_token_ids, bos_token_id=config.bos_token_id)
    if not config.eos_token_ids:
        config.eos_token_ids = tok.eos_token_ids
    if weights is None:
        weights = load_weights(path)
        check_weights(config, weights, path)
    try:
        model = LlamaModel(config, weights, device=device,
                           dtype=torch_dtype, attention_backend=attention_backend, quantization=quantization,
                           cpu_matmul=cpu_matmul, cpu_pack_weights=cpu_pack_weights)
    except KeyError as e:
        raise ModelLoadError(f"{path}: {e.args[0]}") from None
    return model, tok
