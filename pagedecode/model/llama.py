"""Llama-family forward pass over the paged KV cache.

Covers Llama 2 / 3.x (rope scaling), Mistral, Qwen2 / 2.5 (q/k/v bias), Qwen3 (q/k RMSNorm),
SmolLM and TinyLlama (Llama shapes); tied or untied embeddings. Attention never sees K/V
except through the cache: each layer writes the new tokens' K/V, then attends over the pages.
One layer loop (forward) over the ops chosen at load (model/layer_ops.py: torch, Triton, their
deterministic kinds). On CPU the whole stack runs as one compiled call where it applies
(model/cpu_forward.py); the loop over the torch ops is what tests hold it to.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .. import env
from ..progress import progress
from ..kernels.rope import apply_rope, rope_cos_sin, rope_inv_freq
from .batch import ForwardBatch
from .config import ModelConfig
from .kv_cache import KVCache
from .layer_ops import TorchOps, add_lora, choose_ops
from .quant import BLOCK, QuantizedWeight, RowStack, Weight, block_kinds, cat_rows, embedding_rows, weight_bytes

# read at call time (a test switches the compiled forward off by setting cpu_forward._cpu_ext)
from . import cpu_forward as compiled

ROPE_FIRST_POSITIONS = 4096          # the RoPE tables' rows at construction; forward grows them


def _storage_key(w: Weight) -> int:
    """One key per block of memory: the tied LM head is the embedding, the compiled forward's
    list holds the model's own tensors and quantized blocks (a RowStack's parts' one by one:
    _storages); oneDNN's packed copies have no plain storage (their own id)."""
    assert not isinstance(w, RowStack), "a RowStack's parts each have their own storage (_storages)"
    if isinstance(w, QuantizedWeight):
        return int(w.blocks.data_ptr())
    if w.is_mkldnn:
        return id(w)
    return int(w.data_ptr()) or id(w)


@dataclass
class _Layer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv_w: Weight                       # q, k, v projections stacked: one matmul
    qkv_b: torch.Tensor | None
    o_w: Weight
    o_b: torch.Tensor | None
    q_norm: torch.Tensor | None         # Qwen3
    k_norm: torch.Tensor | None
    gate_up_w: Weight                   # gate and up stacked: one matmul
    down_w: Weight


class LlamaModel:
    """A pd.Model: `config`, `device`, `dtype` and forward(batch, kv_cache) -> logits (N, V).

    Weights are float tensors or QuantizedWeight blocks (model/quant.py) as `weights` holds them;
    `quantization` ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1") also quantizes every float layer weight whose input size is
    a multiple of 32, and the LM head to Q8_0 (as llama.cpp keeps the output above the layers'
    type); the embedding (a tied head's table too) and the norms keep their type. cpu_matmul and
    cpu_pack_weights: see configure_cpu (None: the environment's default, as EngineConfig's)."""

    applies_lora = True         # batches may carry LoRA adapters (ForwardBatch.lora); not a tensor-parallel shard

    def __init__(self, config: ModelConfig, weights: Mapping[str, Weight],
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 attention_backend: str = "auto", quantization: str | None = None,
                 cpu_matmul: str | None = None, cpu_pack_weights: bool | None = None) -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.attention_backend = attention_backend
        self.quantization = quantization
        c = config

        def take(name: str, required: bool = True, own: bool = True) -> Any:
            t = weights.get(name)
            if t is None:
                if required:
                    raise KeyError(f"checkpoint has no tensor {name!r}")
                return None
            # never the caller's memory (own): a file's memory map (safetensors, GGUF) would stay
            # mapped for it, every page the stacked layers read resident beside their stacked copies
            if isinstance(t, QuantizedWeight):
                q = t.to(self.device)
                shared = q.blocks.data_ptr() == t.blocks.data_ptr()
                return QuantizedWeight(q.kind, q.blocks.clone(), q.shape) if own and shared else q
            if isinstance(t, RowStack):
                return t.to(self.device)
            out = t.to(device=self.device, dtype=dtype).contiguous()
            return out.clone() if own and out.data_ptr() == t.data_ptr() else out

        def stack(*names: str) -> Weight:
            w = cat_rows([take(n, own=False) for n in names], dtype)       # a copy
            if quantization and isinstance(w, torch.Tensor) and w.shape[1] % BLOCK == 0:
                return QuantizedWeight.quantize(w, quantization)
            return w

        self.embed = take("model.embed_tokens.weight")
        lm = take("lm_head.weight", required=False)
        if lm is None:          # tied (also when a checkpoint ties without saying so, as HF then does)
            lm = self.embed
        if quantization and isinstance(lm, torch.Tensor) and lm.shape[1] % BLOCK == 0:
            lm = QuantizedWeight.quantize(lm, "q8_0")      # the head in Q8_0 whatever the layers take
        self.lm_head = lm
        self.final_norm = take("model.norm.weight")
        self.layers = []
        for i in progress(range(c.num_layers), "loading layers", total=c.num_layers):
            p = f"model.layers.{i}."
            biases = [take(p + f"self_attn.{n}_proj.bias", required=False) for n in "qkv"]
            self.layers.append(_Layer(
                ln1=take(p + "input_layernorm.weight"), ln2=take(p + "post_attention_layernorm.weight"),
                qkv_w=stack(*(p + f"self_attn.{n}_proj.weight" for n in "qkv")),
                qkv_b=torch.cat(biases, 0) if all(b is not None for b in biases) else None,
                o_w=stack(p + "self_attn.o_proj.weight"), o_b=take(p + "self_attn.o_proj.bias", required=False),
                q_norm=take(p + "self_attn.q_norm.weight", required=c.qk_norm),
                k_norm=take(p + "self_attn.k_norm.weight", required=c.qk_norm),
                gate_up_w=stack(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                down_w=stack(p + "mlp.down_proj.weight")))
        scaling = c.rope_scaling
        self._rope_inv = rope_inv_freq(c.head_dim, c.rope_theta, scaling)
        self._rope_factor = float(scaling["attention_factor"]) if scaling and scaling.get("attention_factor") else 1.0
        # the RoPE tables cover the positions batches reach (grown in forward), not the declared
        # context: a checkpoint may declare 2^24 positions (gigabytes of table) and use a few thousand
        cos, sin = self._rope_tables(min(c.max_position_embeddings, ROPE_FIRST_POSITIONS))
        self.scale = 1.0 / math.sqrt(c.head_dim)
        self._q_size = c.num_heads * c.head_dim
        self._kv_size = c.num_kv_heads * c.head_dim
        self.quantized = any(isinstance(w, (QuantizedWeight, RowStack)) for w in self._weights())
        # quantized layers on CPU: the compiled int8 kernel, unless "torch" asks for the dequantizing
        # reference; on CUDA (kernel None) linear() takes kernels/quant_matmul.py's Triton GEMV / GEMM
        self._quant_kernel = compiled.quant_kernel(self.device, attention_backend)
        # the layer's ops (model/layer_ops.py), chosen here and when deterministic mode is switched:
        # batch-invariant kernels (EngineConfig.deterministic) order every reduction one way whatever
        # the batch, chunking or thread count
        self._deterministic = False
        self.ops: TorchOps = self._choose_ops()
        # the one-call CPU forward (model/cpu_forward.py), not for a tensor-parallel shard (which
        # overrides _embed / _reduce / _logits)
        self._compiled: compiled.CompiledForward | None = None
        kinds = {k for w in self._weights() for k in block_kinds(w)}
        if type(self) is LlamaModel and compiled.applies(c, self.device, dtype, kinds):
            if self.quantized and self._quant_kernel is not None:
                compiled.pack_quantized(self)      # the compiled kernels multiply them (not "torch"'s reference)
            self._compiled = compiled.CompiledForward(c, self.layers, self.embed, self.lm_head, self.final_norm,
                                                      cos, sin, dtype, self.scale)
            self.configure_cpu(env.cpu_matmul() if cpu_matmul is None else cpu_matmul,
                               env.cpu_pack_weights() if cpu_pack_weights is None else cpu_pack_weights)

    def _rope_tables(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sets cos / sin (positions, head_dim) in the model's dtype; returns them in float32."""
        cos, sin = rope_cos_sin(self._rope_inv, positions, self._rope_factor)
        self.cos, self.sin = cos.to(self.device, self.dtype), sin.to(self.device, self.dtype)
        return cos, sin

    def _cover_positions(self, batch: ForwardBatch, kv: KVCache) -> None:
        """Grow the RoPE tables (doubling, up to the declared context) to every position the
        batch's page table can address; host-side shapes only, no device sync."""
        need = min(batch.page_table.shape[1] * kv.page_size, self.config.max_position_embeddings)
        have = self.cos.shape[0]
        if need > have:
            cos, sin = self._rope_tables(min(max(need, 2 * have), self.config.max_position_embeddings))
            if self._compiled is not None:
                self._compiled.set_rope(cos, sin)

    def configure_cpu(self, matmul: str = "onednn", pack_weights: bool = True) -> None:
        """How the compiled CPU forward multiplies (EngineConfig.cpu_matmul / cpu_pack_weights;
        an engine calls this with its config): "onednn" takes oneDNN's linear for matmuls of more
        than a few rows, "aten" at::mm; pack_weights keeps each float weight also in oneDNN's
        blocked layout (given a plain weight, oneDNN re-blocks it on every call), or in
        deterministic mode in det_linear's (csrc/det_matmul.h; unpacked, each call packs): a
        second copy of the weights, made or dropped here. No effect off the compiled forward."""
        if matmul not in ("onednn", "aten"):
            raise ValueError(f"matmul must be 'onednn' or 'aten', got {matmul!r}")
        if self._compiled is not None:
            self._compiled.configure(matmul, pack_weights)

    @property
    def deterministic(self) -> bool:
        return self._deterministic

    @deterministic.setter
    def deterministic(self, on: bool) -> None:
        ops = self._choose_ops(bool(on))         # raises where this device has no deterministic kernels
        self._deterministic, self.ops = bool(on), ops
        if self._compiled is not None:
            self._compiled.set_deterministic(self._deterministic)

    def _choose_ops(self, deterministic: bool = False) -> TorchOps:
        return choose_ops(self.device, self.attention_backend, self.scale, self._quant_kernel, deterministic,
                          compiled.cpu_ext())

    def _storages(self) -> list[torch.Tensor | QuantizedWeight]:
        """The weights by block of memory: a RowStack as its parts."""
        return [p for w in self._weights() for p in (w.parts if isinstance(w, RowStack) else [w])]

    def _weights(self) -> list[Weight]:
        out: list[Weight] = [self.embed, self.final_norm]
        if self.lm_head is not self.embed:
            out.append(self.lm_head)
        for L in self.layers:
            out += [t for t in (L.ln1, L.ln2, L.qkv_w, L.qkv_b, L.o_w, L.o_b, L.q_norm, L.k_norm,
                                L.gate_up_w, L.down_w) if t is not None]
        return out

    def weight_formats(self) -> dict[str, int]:
        """Bytes of the weights by the format they are held in ("q8_0", "float32", ...), and the
        compiled forward's derived copies (transposed small layers, packed copies) as "copies";
        they add up to weight_bytes."""
        seen: dict[int, tuple[str, int]] = {}
        own = self._storages()
        for w in own:
            kind = w.kind if isinstance(w, QuantizedWeight) else str(w.dtype).removeprefix("torch.")
            seen.setdefault(_storage_key(w), (kind, weight_bytes(w)))
        for w in self._compiled.tensors() if self._compiled is not None else []:
            seen.setdefault(_storage_key(w), ("copies", weight_bytes(w)))    # the model's own are seen already
        out: dict[str, int] = {}
        for kind, size in seen.values():
            if size:
                out[kind] = out.get(kind, 0) + size
        return out

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights take in memory, as the forward holds them (quantized blocks at their
        size; the compiled CPU forward's transposed and packed copies included)."""
        seen: dict[int, int] = {}
        extra = self._compiled.tensors() if self._compiled is not None else []
        for w in self._storages() + extra:
            seen[_storage_key(w)] = weight_bytes(w)
        return sum(seen.values())

    def uses_cpu_extension(self) -> bool:
        """True when forward runs the compiled CPU pass (attention_backend "auto" on CPU); "torch"
        forces the torch path, which tests hold the compiled one to."""
        return self._compiled is not None and self.attention_backend == "auto"

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        self._cover_positions(batch, kv)
        if (self._compiled is not None and self.attention_backend == "auto" and self._compiled.runs(kv)
                and (batch.lora is None or compiled.takes_lora())):
            return self._compiled.forward(batch, kv)
        c, ops = self.config, self.ops
        T, H, Hkv, D = batch.num_tokens, c.num_heads, c.num_kv_heads, c.head_dim
        q_end, k_end = self._q_size, self._q_size + self._kv_size       # qkv's columns: q | k | v
        h = self._embed(batch.input_ids)                                  # (T, hidden)
        cos, sin = self.cos[batch.positions], self.sin[batch.positions]   # (T, head_dim)
        ctx = ops.context(batch, kv)
        lora = batch.lora
        for i, L in enumerate(self.layers):
            x = ops.norm(h, L.ln1, c.rms_norm_eps)
            qkv = ops.linear(x, L.qkv_w, L.qkv_b)                         # (T, (H + 2 Hkv) D)
            if lora is not None:
                add_lora(ops, lora, i, x, qkv, (("q_proj", 0), ("k_proj", q_end), ("v_proj", k_end)))
            v = qkv[:, k_end:].view(T, Hkv, D)
            if L.q_norm is None:     # rotate q and k in one go
                qk = apply_rope(qkv[:, :k_end].view(T, H + Hkv, D), cos, sin)
                q, k = qk[:, :H], qk[:, H:]
            else:
                assert L.k_norm is not None
                q = ops.norm(qkv[:, :q_end].view(T, H, D), L.q_norm, c.rms_norm_eps)
                k = ops.norm(qkv[:, q_end:k_end].view(T, Hkv, D), L.k_norm, c.rms_norm_eps)
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            scales = kv.scales(i)                                         # an 8-bit cache's, else None
            ops.write_kv(kv.k[i], kv.v[i], k, v, batch.slot_mapping, scales)
            attn = ops.attention(q, kv.k[i], kv.v[i], batch, ctx, scales)  # (T, H, D)
            attn_rows = attn.reshape(T, q_end)
            o = ops.linear(attn_rows, L.o_w, L.o_b)
            if lora is not None:
                add_lora(ops, lora, i, attn_rows, o, (("o_proj", 0),))
            h = h + self._reduce(o)
            x = ops.norm(h, L.ln2, c.rms_norm_eps)
            gate_up = ops.linear(x, L.gate_up_w)                          # (T, 2 I)
            if lora is not None:
                add_lora(ops, lora, i, x, gate_up, (("gate_proj", 0), ("up_proj", c.intermediate_size)))
            act = ops.silu_mul(gate_up)
            down = ops.linear(act, L.down_w)
            if lora is not None:
                add_lora(ops, lora, i, act, down, (("down_proj", 0),))
            h = h + self._reduce(down)
        h = ops.norm(h[batch.logits_indices], self.final_norm, c.rms_norm_eps)
        return self._logits(h)                                           # (N, vocab)

    # -- the three places tensor parallelism changes (model/parallel.py); identity at N = 1 --------
    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return embedding_rows(self.embed, ids, self.dtype)

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(h, self.lm_head).float()
