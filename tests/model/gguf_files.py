"""Writing small GGUF files for the tests, as llama.cpp's convert_hf_to_gguf.py lays them out:
a Hugging Face state dict with q/k rows permuted for llama.cpp's RoPE, each weight in the type
asked, and the tokenizer as tokenizer.ggml.* metadata."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

gguf = __import__("gguf")
Q = gguf.GGMLQuantizationType
GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def gguf_name(hf: str) -> str:
    if hf in GGUF_NAMES:
        return GGUF_NAMES[hf]
    _, _, i, *rest = hf.split(".")
    return f"blk.{i}.{LAYER['.'.join(rest[:-1])]}.{rest[-1]}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's q/k permutation (HF rotate-half rows -> adjacent pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_kquant(rows: int, cols: int, qtype, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K / Q5_K / Q6_K blocks (gguf cannot quantize to them) with small fp16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    if qtype in (Q.Q4_K, Q.Q5_K):     # d, dmin, 12 bytes of 6-bit scales, (Q5_K: 32 bytes of 5th bits,) nibbles
        data[..., 0:4] = np.frombuffer(np.array([0.002, 0.001], dtype=np.float16).tobytes(), np.uint8)
    else:                             # Q6_K: ql, qh, 16 int8 scales, then d
        data[..., 192:208] = rng.integers(-8, 8, size=(rows, cols // block, 16)).astype(np.int8).view(np.uint8)
        data[..., 208:210] = np.frombuffer(np.array([0.0005], dtype=np.float16).tobytes(), np.uint8)
    return data.reshape(rows, -1)


def encode_tensor(w: np.ndarray, qtype, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(what the file stores, its values as float32 the loader should see)."""
    if qtype == Q.F32 or w.ndim == 1:
        return w.astype(np.float32), w.astype(np.float32)
    if qtype == Q.F16:
        return w.astype(np.float16), w.astype(np.float16).astype(np.float32)
    kquant = qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K)
    data = random_kquant(*w.shape, qtype, rng) if kquant else gguf.quants.quantize(w, qtype)
    return data, gguf.quants.dequantize(data, qtype)


def write_gguf(path: Path, cfg: dict, weights: dict[str, torch.Tensor], tokenizer_meta: dict,
               qtype=Q.F32, arch: str = "llama", seed: int = 0,
               overrides: dict[str, tuple] | None = None, qtypes: dict[str, "Q"] | None = None
               ) -> dict[str, torch.Tensor]:
    """Write the model; return the weights (HF names and layout) as the file's values give them.
    `overrides`: key -> (value, gguf.GGUFValueType) written over what cfg gives (hostile files);
    qtypes: a type per tensor whose HF name contains the key (a mix, as llama.cpp's Q4_K_M is)."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    if "head_dim" in cfg:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    for key, value in tokenizer_meta.items():
        getattr(w, "add_" + key)(value)
    for key, (value, vtype) in (overrides or {}).items():
        w.add_key_value(key, value, vtype)
    expected = {}
    for name, t in weights.items():
        arr = t.float().numpy()
        heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
        proj = name.split(".")[-2]
        permuted = arch == "llama" and proj in heads
        if permuted:
            arr = permute(arr, heads[proj])
        own = next((q for key, q in (qtypes or {}).items() if key in name), qtype)
        data, values = encode_tensor(arr, own, rng)
        if data.dtype == np.uint8:
            w.add_tensor(gguf_name(name), data, raw_shape=data.shape, raw_dtype=own)
        else:
            w.add_tensor(gguf_name(name), data)
        expected[name] = torch.from_numpy(np.ascontiguousarray(unpermute(values, heads[proj]) if permuted else values))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def bytelevel_tokenizer_meta(tokenizer_json: Path, bos: str, eos: str) -> dict:
    """gpt2 (byte-level BPE) tokenizer metadata from a tokenizers tokenizer.json."""
    t = json.loads(tokenizer_json.read_text())
    vocab = dict(t["model"]["vocab"])
    for added in t["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [tok for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    specials = {a["content"] for a in t["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in t["model"]["merges"]]
    return {"tokenizer_model": "gpt2", "tokenizer_pre": "gpt2", "token_list": tokens,
            "token_types": [3 if tok in specials else 1 for tok in tokens], "token_merges": merges,
            "bos_token_id": vocab[bos], "eos_token_id": vocab[eos], "add_bos_token": True}


def random_llama(seed: int = 0, vocab: int = 512) -> tuple[dict, dict[str, torch.Tensor]]:
    """A random Llama whose every layer input is a multiple of 256 (K-quant blocks)."""
    cfg = {"model_type": "llama", "vocab_size": vocab, "hidden_size": 256, "intermediate_size": 512,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu"}
    g = torch.Generator().manual_seed(seed)
    h, f, kv = 256, 512, 2 * 64

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * shape[-1] ** -0.5

    weights = {"model.embed_tokens.weight": torch.randn(vocab, h, generator=g),
               "model.norm.weight": 1 + 0.1 * torch.randn(h, generator=g), "lm_head.weight": r(vocab, h)}
    for i in range(2):
        p = f"model.layers.{i}."
        weights.update({p + "input_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
                        p + "post_attention_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
                        p + "self_attn.q_proj.weight": r(h, h), p + "self_attn.k_proj.weight": r(kv, h),
                        p + "self_attn.v_proj.weight": r(kv, h), p + "self_attn.o_proj.weight": r(h, h),
                        p + "mlp.gate_proj.weight": r(f, h), p + "mlp.up_proj.weight": r(f, h),
                        p + "mlp.down_proj.weight": r(h, f)})
    return cfg, weights
