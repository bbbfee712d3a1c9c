"""LoRA adapters for tests: written by peft over a transformers model (the reference), or by hand
in PEFT's file format (for the checks of bad files, and servers over stories260k)."""
from copy import deepcopy
import json
import zlib
from pathlib import Path

import torch

SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
         "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def peft_adapter(hf_base, folder: Path, r: int, alpha: float, targets=SEVEN, use_rslora=False, std=0.05,
                 copy=True):
    """A peft LoRA over a copy of hf_base (copy=False: over hf_base itself, which it changes) with
    random non-zero A and B (seeded by the folder's name), saved to `folder`; returns the peft
    model (the reference forward)."""
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(deepcopy(hf_base) if copy else hf_base, LoraConfig(
        r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, use_rslora=use_rslora,
        init_lora_weights=False))
    torch.manual_seed(zlib.crc32(folder.name.encode()))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, std)
    model.save_pretrained(folder)
    return model.eval()


def shapes(config: dict) -> dict:
    """(out, in) of each projection under a config.json."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    d = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}


def write_adapter(folder: Path, config: dict, r: int = 4, alpha: float = 8.0, targets=SEVEN, std=0.05,
                  layers=None, extra_tensors=None, config_extra=None, drop=()) -> Path:
    """An adapter in PEFT's files written by hand for a model of config.json `config`: random A
    and B (seeded by the folder's name); `drop` leaves tensors out, `extra_tensors` adds some."""
    from safetensors.torch import save_file
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(zlib.crc32(folder.name.encode()))
    tensors = {}
    sh = shapes(config)
    for layer in range(config["num_hidden_layers"]) if layers is None else layers:
        for proj in targets:
            n_out, n_in = sh[proj]
            base = f"base_model.model.model.layers.{layer}.{BLOCK[proj]}.{proj}"
            tensors[f"{base}.lora_A.weight"] = torch.randn(r, n_in, generator=g) * std
            tensors[f"{base}.lora_B.weight"] = torch.randn(n_out, r, generator=g) * std
    for name in drop:
        tensors.pop(name)
    tensors.update(extra_tensors or {})
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets), "bias": "none",
           "use_rslora": False, "lora_dropout": 0.0, **(config_extra or {})}
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    return folder
