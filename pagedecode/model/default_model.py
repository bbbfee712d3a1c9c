"""The built-in default model: a deterministic tiny Llama the package makes itself.

Seeded random weights plus a byte-level BPE tokenizer trained with `tokenizers` on the text in
pagedecode/data/corpus.txt, written as an ordinary Hugging Face directory (config.json,
generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json) and loaded
through the normal loader. Made once and cached; its text is fluent in nothing, but it is a
real Llama forward over a real tokenizer, so every piece of the runtime runs.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .. import env

VERSION = "v2"
SHAPE = dict(vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
BOS, EOS = "<|bos|>", "<|eos|>"


def cache_dir() -> Path:
    return env.cache_root() / f"default-model-{VERSION}"


def default_model_path() -> Path:
    """The default model's directory, made on first use."""
    path = cache_dir()
    if not (path / "model.safetensors").is_file():
        path.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        write_default_model(tmp)
        for f in tmp.iterdir():
            os.replace(f, path / f.name)        # model.safetensors last-or-not, each file atomic
        tmp.rmdir()
    return path


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    text = (Path(__file__).resolve().parent.parent / "data" / "corpus.txt").read_text()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=SHAPE["vocab_size"], special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text.split("\n\n"), trainer)
    return tok


def _add_bias_channel(weights: dict, tok, layers: int) -> None:
    """Give the head a per-token bias through residual dimension 0: every embedding carries a
    constant there and no layer writes to it, so after the final norm it is a positive constant
    and lm_head[:, 0] acts as a bias. Used to keep this random model away from stray bytes
    (which would print as broken characters) and towards the corpus's merged word pieces."""
    from .tokenizer import byte_alphabet
    alphabet = byte_alphabet()
    weights["model.embed_tokens.weight"][:, 0] = 8.0
    for i in range(layers):
        weights[f"model.layers.{i}.self_attn.o_proj.weight"][0, :] = 0.0
        weights[f"model.layers.{i}.mlp.down_proj.weight"][0, :] = 0.0
    bias = weights["lm_head.weight"][:, 0]
    for token, i in tok.get_vocab().items():
        raw = bytes(alphabet[ch] for ch in token) if all(ch in alphabet for ch in token) else b""
        if token in (BOS, EOS):
            bias[i] = -2.0 if token == BOS else -0.4
        elif len(raw) == 1 and (raw[0] >= 0x80 or (raw[0] < 0x20 and raw != b"\n")):
            bias[i] = -2.0
        elif len(raw) > 2:
            bias[i] = 0.4


def write_default_model(path: Path) -> None:
    from safetensors.torch import save_file
    tok = _train_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    c = SHAPE
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    g = torch.Generator().manual_seed(20261202)

    def w(*shape, std):
        return (torch.randn(*shape, generator=g) * std).contiguous()

    h, f, kvd = c["hidden_size"], c["intermediate_size"], c["num_key_value_heads"] * head_dim
    weights = {"model.embed_tokens.weight": w(c["vocab_size"], h, std=1.0),
               "model.norm.weight": torch.ones(h),
               "lm_head.weight": w(c["vocab_size"], h, std=2.5 * h ** -0.5)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": w(h, h, std=h ** -0.5), p + "self_attn.k_proj.weight": w(kvd, h, std=h ** -0.5),
            p + "self_attn.v_proj.weight": w(kvd, h, std=h ** -0.5), p + "self_attn.o_proj.weight": w(h, h, std=h ** -0.5),
            p + "mlp.gate_proj.weight": w(f, h, std=h ** -0.5), p + "mlp.up_proj.weight": w(f, h, std=h ** -0.5),
            p + "mlp.down_proj.weight": w(h, f, std=f ** -0.5)})
    _add_bias_channel(weights, tok, c["num_hidden_layers"])
    save_file(weights, str(path / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
              "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": "float32", "head_dim": head_dim, **c}
    (path / "config.json").write_text(json.dumps(config, indent=1))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": False}))
