"""ModelConfig: the shape of a Llama-family model, read from a Hugging Face config.json."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ..errors import ModelLoadError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# GGUF's general.architecture -> model_type (llama.cpp writes Mistral 7B as "llama")
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
NO_TOKEN = 0xFFFFFFFF             # how llama.cpp's converters write "no such token"
# field -> (its config.json key, its GGUF key after "<arch>.", the largest value believed): a
# checkpoint's sizes are checked before anything is sized by them (the tensors' shapes, at load,
# by model/shapes.py)
SIZE_FIELDS = {
    "vocab_size": ("vocab_size", "vocab_size", 1 << 24),
    "hidden_size": ("hidden_size", "embedding_length", 1 << 20),
    "intermediate_size": ("intermediate_size", "feed_forward_length", 1 << 22),
    "num_layers": ("num_hidden_layers", "block_count", 1 << 12),
    "num_heads": ("num_attention_heads", "attention.head_count", 1 << 12),
    "num_kv_heads": ("num_key_value_heads", "attention.head_count_kv", 1 << 12),
    "head_dim": ("head_dim", "attention.key_length", 1 << 12),
    "max_position_embeddings": ("max_position_embeddings", "context_length", (1 << 31) - 1),
}


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None
    tie_word_embeddings: bool = False
    qk_norm: bool = False                  # Qwen3: RMSNorm over each head of q and k
    sliding_window: int | None = None      # when set, the usable context is capped at it
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    dtype: str = "float32"                 # the checkpoint's own dtype

    def __post_init__(self) -> None:
        for name, (hf_key, gguf_key, most) in SIZE_FIELDS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
                raise ModelLoadError(f"the model's {name} (config.json {hf_key}, GGUF <arch>.{gguf_key}) is "
                                     f"{_short(value)}: it must be a whole number from 1 to {most}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_attention_heads {self.num_heads} is not a multiple of "
                                 f"num_key_value_heads {self.num_kv_heads}")
        self.check_token_ids()

    def check_token_ids(self) -> None:
        """BOS and every EOS id name a row of the vocabulary (an id past it would index past the
        embedding and the logits)."""
        for what, ids in (("bos_token_id", () if self.bos_token_id is None else (self.bos_token_id,)),
                          ("eos_token_id", self.eos_token_ids)):
            for i in ids:
                if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.vocab_size:
                    raise ModelLoadError(f"the model's {what} {_short(i)} is outside its vocabulary of "
                                         f"{self.vocab_size} tokens")

    @property
    def max_context(self) -> int:
        """Tokens one sequence may hold in its cache."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        mtype = cfg.get("model_type")
        if mtype not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(f"unsupported model_type {mtype!r} (architectures "
                                 f"{cfg.get('architectures')}); supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"unsupported hidden_act {cfg.get('hidden_act')!r} (only silu)")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in cfg]
        if missing:
            raise ModelLoadError(f"config.json has no {', '.join(missing)}")
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_scaling") or None
        params = cfg.get("rope_parameters") or {}
        theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
        if rope is None and params.get("rope_type", "default") != "default":
            rope = params
        window = None
        if mtype == "mistral" or cfg.get("use_sliding_window", False):
            window = cfg.get("sliding_window")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=_default(cfg.get("num_key_value_heads"), heads),
            head_dim=cfg.get("head_dim") or _per_head(cfg["hidden_size"], heads),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=rope,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=(mtype == "qwen3"), sliding_window=window, model_type=mtype,
            bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids,
            dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"))

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], vocab_size: int,
                  rope_factors: list[float] | None = None) -> "ModelConfig":
        """From a GGUF's metadata (key -> value); `rope_factors` is its rope_freqs tensor, which
        is how llama.cpp stores Llama 3.x's rope scaling."""
        arch = meta.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ModelLoadError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")

        def get(key: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise ModelLoadError(f"GGUF metadata has no {arch}.{key}")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ModelLoadError(f"GGUF metadata {arch}.{key} is {_short(value)}, not a number")
            return value

        heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        rope: dict[str, Any] | None = None
        kind = meta.get(f"{arch}.rope.scaling.type", "none")
        if rope_factors is not None:
            rope = {"rope_type": "freq_factors", "factors": rope_factors}
        elif kind == "linear":
            rope = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
        elif kind != "none":
            raise ModelLoadError(f"unsupported GGUF rope scaling {kind!r} (supported: none, linear, rope_freqs)")
        special = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        bos = meta.get("tokenizer.ggml.bos_token_id")
        head_dim = int(get("attention.key_length", _per_head(hidden, heads)))
        if int(get("rope.dimension_count", head_dim)) != head_dim:
            raise ModelLoadError(f"partial rotary embedding ({arch}.rope.dimension_count "
                                 f"{meta.get(f'{arch}.rope.dimension_count')} of head_dim {head_dim}) is not supported")
        return cls(
            vocab_size=int(get("vocab_size", vocab_size)), hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")), num_layers=int(get("block_count")),
            num_heads=heads, num_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=head_dim, max_position_embeddings=int(get("context_length")),
            rms_norm_eps=_float32(get("attention.layer_norm_rms_epsilon")),
            rope_theta=_float32(get("rope.freq_base", 10000.0)), rope_scaling=rope,
            qk_norm=(arch == "qwen3"), model_type=GGUF_ARCHITECTURES[arch],
            bos_token_id=None if bos in (None, NO_TOKEN) else int(bos),
            eos_token_ids=tuple(dict.fromkeys(int(i) for i in special if i not in (None, NO_TOKEN))))


def _default(value: Any, default: Any) -> Any:
    """A config value, or `default` when it is absent (None); 0 stays 0, to be refused."""
    return default if value is None else value


def _per_head(hidden: Any, heads: Any) -> Any:
    """hidden / heads, the head_dim a config leaves implicit; the bad values pass through for
    __post_init__ to name."""
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return heads


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _float32(value: Any) -> float:
    """GGUF stores these as float32: 1e-5 reads back as 9.99999974e-06; take the shortest decimal
    that rounds to the same float32, which is what the converter was given."""
    import numpy as np
    return float(str(np.float32(value)))
