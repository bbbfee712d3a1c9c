"""Llama-family forward pass over the paged KV cache.

Covers Llama 2 / 3.x (rope scaling), Mistral, Qwen2 / 2.5 (q/k/v bias), Qwen3 (q/k RMSNorm),
SmolLM and TinyLlama (Llama shapes); tied or untied embeddings. Attention never sees K/V
except through the cache: each layer writes the new tokens' K/V, then attends over the pages.
On CPU the whole stack runs as one compiled call where it applies (model/cpu_forward.py); the
torch path here is what tests hold it to.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from ..kernels._backend import use_triton
from ..kernels.decode_attention import attend_gathered, context_slots, paged_decode_attention
from ..kernels.extend_attention import paged_extend_attention
from ..kernels.kv_write import write_kv
from ..kernels.matmul import deterministic_linear
from ..kernels.quant_matmul import quant_matmul_deterministic
from ..kernels.rmsnorm import rms_norm, rms_norm_triton
from ..kernels.rope import apply_rope, rope_cos_sin, rope_inv_freq
from .batch import ForwardBatch
from .config import ModelConfig
from .kv_cache import KVCache
from .quant import BLOCK, QuantizedWeight, RowStack, Weight, cat_rows, embedding_rows, linear, weight_bytes

# read at call time (a test switches the compiled forward off by setting cpu_forward._cpu_ext)
from . import cpu_forward as compiled
from .cpu_forward import default_cpu_matmul, default_cpu_pack_weights


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

    def __init__(self, config: ModelConfig, weights: Mapping[str, Weight],
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 attention_backend: str = "auto", quantization: str | None = None,
                 cpu_matmul: str | None = None, cpu_pack_weights: bool | None = None) -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.attention_backend = attention_backend
        self.quantization = quantization
        # batch-invariant kernels (EngineConfig.deterministic sets it): every reduction in one order
        # whatever the batch, chunking or thread count
        self._deterministic = False
        c = config

        def take(name: str, required: bool = True) -> Any:
            t = weights.get(name)
            if t is None:
                if required:
                    raise KeyError(f"checkpoint has no tensor {name!r}")
                return None
            if isinstance(t, (QuantizedWeight, RowStack)):
                return t.to(self.device)
            return t.to(device=self.device, dtype=dtype).contiguous()

        def stack(*names: str) -> Weight:
            w = cat_rows([take(n) for n in names], dtype)
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
        for i in range(c.num_layers):
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
        inv = rope_inv_freq(c.head_dim, c.rope_theta, scaling)
        factor = 1.0
        if scaling and scaling.get("attention_factor"):
            factor = float(scaling["attention_factor"])
        cos, sin = rope_cos_sin(inv, c.max_position_embeddings, factor)
        self.cos = cos.to(self.device, dtype)
        self.sin = sin.to(self.device, dtype)
        self.scale = 1.0 / math.sqrt(c.head_dim)
        self._q_size = c.num_heads * c.head_dim
        self._kv_size = c.num_kv_heads * c.head_dim
        self.quantized = any(isinstance(w, (QuantizedWeight, RowStack)) for w in self._weights())
        # quantized layers on CPU: the compiled int8 kernel, unless "torch" asks for the dequantizing
        # reference; on CUDA (kernel None) linear() takes kernels/quant_matmul.py's Triton GEMV / GEMM
        self._quant_kernel = compiled.quant_kernel(self.device, attention_backend)
        # the one-call CPU forward (model/cpu_forward.py), not for a tensor-parallel shard (which
        # overrides _embed / _reduce / _logits)
        self._compiled: compiled.CompiledForward | None = None
        kinds = {w.kind for w in self._weights() if isinstance(w, (QuantizedWeight, RowStack))}
        if type(self) is LlamaModel and compiled.applies(c, self.device, dtype, kinds):
            if self.quantized and self._quant_kernel is not None:
                compiled.pack_quantized(self)      # the compiled kernels multiply them (not "torch"'s reference)
            self._compiled = compiled.CompiledForward(c, self.layers, self.embed, self.lm_head, self.final_norm,
                                                      cos, sin, dtype, self.scale, self.quantized)
            self.configure_cpu(default_cpu_matmul() if cpu_matmul is None else cpu_matmul,
                               default_cpu_pack_weights() if cpu_pack_weights is None else cpu_pack_weights)

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
        self._deterministic = bool(on)
        if self._compiled is not None:
            self._compiled.set_deterministic(self._deterministic)

    def _weights(self) -> list[Weight]:
        out: list[Weight] = [self.embed, self.final_norm]
        if self.lm_head is not self.embed:
            out.append(self.lm_head)
        for L in self.layers:
            out += [t for t in (L.ln1, L.ln2, L.qkv_w, L.qkv_b, L.o_w, L.o_b, L.q_norm, L.k_norm,
                                L.gate_up_w, L.down_w) if t is not None]
        return out

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights take in memory, as the forward holds them (quantized blocks at their
        size; the compiled CPU forward's transposed and packed copies included)."""
        seen: dict[int, int] = {}
        extra = self._compiled.tensors() if self._compiled is not None else []
        for w in self._weights() + extra:
            if isinstance(w, RowStack):
                key = id(w)
            elif isinstance(w, QuantizedWeight):
                key = w.blocks.data_ptr()            # the compiled forward's list holds the same blocks
            elif w.is_mkldnn:                    # oneDNN's packed copies have no plain storage
                key = id(w)
            else:
                key = w.data_ptr() or id(w)      # the tied LM head is the embedding: counted once
            seen[key] = weight_bytes(w)
        return sum(seen.values())

    def uses_cpu_extension(self) -> bool:
        """True when forward runs the compiled CPU pass (attention_backend "auto" on CPU); "torch"
        forces the torch path, which tests hold the compiled one to."""
        return self._compiled is not None and self.attention_backend == "auto"

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        c = self.config
        if self._compiled is not None and self.attention_backend == "auto" and self._compiled.runs(kv):
            return self._compiled.forward(batch, kv)
        if self.deterministic and not use_triton(batch.input_ids, self.attention_backend):
            return self._forward_deterministic(batch, kv)
        T = batch.num_tokens
        h = self._embed(batch.input_ids)                                  # (T, hidden)
        cos, sin = self.cos[batch.positions], self.sin[batch.positions]   # (T, head_dim)
        ctx = self._decode_context(batch, kv)
        H, Hkv = c.num_heads, c.num_kv_heads
        # deterministic on the Triton path: RMSNorm one row per program, float projections through
        # kernels/matmul.py (one K order whatever the row count), attention in decode's order
        norm = rms_norm_triton if self._triton_deterministic(h) else rms_norm
        lin = self._linear
        for i, L in enumerate(self.layers):
            x = norm(h, L.ln1, c.rms_norm_eps)
            qkv = lin(x, L.qkv_w, L.qkv_b)                               # (T, (H + 2 Hkv) D)
            v = qkv[:, self._q_size + self._kv_size:].view(T, Hkv, c.head_dim)
            if L.q_norm is None:     # rotate q and k in one go
                qk = apply_rope(qkv[:, :self._q_size + self._kv_size].view(T, H + Hkv, c.head_dim), cos, sin)
                q, k = qk[:, :H], qk[:, H:]
            else:
                assert L.k_norm is not None
                q = norm(qkv[:, :self._q_size].view(T, H, c.head_dim), L.q_norm, c.rms_norm_eps)
                k = norm(qkv[:, self._q_size:self._q_size + self._kv_size].view(T, Hkv, c.head_dim),
                         L.k_norm, c.rms_norm_eps)
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            write_kv(kv.k[i], kv.v[i], k, v, batch.slot_mapping, backend=self.attention_backend)
            attn = self._attention(q, kv.k[i], kv.v[i], batch, ctx)         # (T, heads, head_dim)
            h = h + self._reduce(lin(attn.reshape(T, self._q_size), L.o_w, L.o_b))
            x = norm(h, L.ln2, c.rms_norm_eps)
            gate, up = lin(x, L.gate_up_w, None).chunk(2, dim=-1)
            h = h + self._reduce(lin(F.silu(gate) * up, L.down_w, None))
        h = norm(h[batch.logits_indices], self.final_norm, c.rms_norm_eps)
        return self._logits(h)                                           # (N, vocab)

    def _triton_deterministic(self, x: torch.Tensor) -> bool:
        """Deterministic mode's Triton kernels run: deterministic, and the Triton path (CUDA, or
        attention_backend "triton" under the interpreter)."""
        return self.deterministic and use_triton(x, self.attention_backend)

    def _linear(self, x: torch.Tensor, w: Weight, b: torch.Tensor | None) -> torch.Tensor:
        """Every projection and the LM head. In deterministic mode on the Triton path, float weights
        take kernels/matmul.py (cuBLAS chooses its reduction by shape) and quantized ones the
        quantized GEMM with one config for every row count; otherwise quant.linear (quantized
        layers: the CPU int8 kernel, or on CUDA kernels/quant_matmul.py's GEMV / GEMM by rows)."""
        if isinstance(w, RowStack):
            y = torch.cat([self._linear(x, p, None) for p in w.parts], dim=-1)
            return y if b is None else y + b
        if self._triton_deterministic(x):
            if isinstance(w, torch.Tensor):
                return deterministic_linear(x, w, b, self.attention_backend)
            y = quant_matmul_deterministic(x, w.gguf_blocks(), w.kind, self.attention_backend)
            return y if b is None else y + b
        return linear(x, w, b, self._quant_kernel, self.attention_backend)

    def _forward_deterministic(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """The torch path with the compiled forward's deterministic kernels in place of every
        reduction (matmul, RMSNorm, attention, SiLU x up): what a tensor-parallel shard runs in
        deterministic mode (its collectives sit between the ops), and any model the one-call
        forward does not take (q / k norms). The rest is elementwise, the same bits for any batch."""
        ext = compiled.deterministic_ext(self.device)
        c = self.config
        T, H, Hkv, D = batch.num_tokens, c.num_heads, c.num_kv_heads, c.head_dim
        cos, sin = self.cos[batch.positions], self.sin[batch.positions]
        h = self._embed(batch.input_ids)
        for i, L in enumerate(self.layers):
            x = ext.det_rms_norm(h, L.ln1, c.rms_norm_eps)
            qkv = self._det_linear(x, L.qkv_w, L.qkv_b)
            v = qkv[:, self._q_size + self._kv_size:].view(T, Hkv, D)
            if L.q_norm is None:
                qk = apply_rope(qkv[:, :self._q_size + self._kv_size].view(T, H + Hkv, D), cos, sin)
                q, k = qk[:, :H], qk[:, H:]
            else:
                assert L.k_norm is not None
                q = ext.det_rms_norm(qkv[:, :self._q_size].reshape(T, H, D), L.q_norm, c.rms_norm_eps)
                k = ext.det_rms_norm(qkv[:, self._q_size:self._q_size + self._kv_size].reshape(T, Hkv, D),
                                     L.k_norm, c.rms_norm_eps)
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            write_kv(kv.k[i], kv.v[i], k, v, batch.slot_mapping, backend="torch")
            attn = ext.det_attention(q, kv.k[i], kv.v[i], batch.page_table, batch.seq_lens, batch.cu_q, self.scale)
            h = h + self._reduce(self._det_linear(attn.reshape(T, self._q_size), L.o_w, L.o_b))
            x = ext.det_rms_norm(h, L.ln2, c.rms_norm_eps)
            act = ext.silu_mul(self._det_linear(x, L.gate_up_w))
            h = h + self._reduce(self._det_linear(act, L.down_w))
        h = ext.det_rms_norm(h[batch.logits_indices], self.final_norm, c.rms_norm_eps)
        return self._logits(h)

    def _det_linear(self, x: torch.Tensor, w: Weight, b: torch.Tensor | None = None) -> torch.Tensor:
        """x @ w^T (+ b) through the compiled det_linear, on w's det_pack copy (csrc/det_matmul.h),
        made on first use and kept: a second copy of the float weights, as the compiled forward
        keeps in deterministic mode (without it every call packs; quantized blocks need none, and
        an older build has no det_pack)."""
        ext = compiled.deterministic_ext(self.device)
        if isinstance(w, RowStack):
            y = torch.cat([self._det_linear(x, p) for p in w.parts], dim=-1)
            return y if b is None else y + b
        if not isinstance(w, torch.Tensor) or not hasattr(ext, "det_pack"):
            return ext.det_linear(x, compiled.plain(w), b)
        cache: dict[int, torch.Tensor] = self.__dict__.setdefault("_det_packs", {})
        if id(w) not in cache:
            cache[id(w)] = ext.det_pack(w)
        return ext.det_linear(x, w, b, cache[id(w)])

    # -- the three places tensor parallelism changes (model/parallel.py); identity at N = 1 --------
    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return embedding_rows(self.embed, ids, self.dtype)

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.deterministic and not use_triton(h, self.attention_backend):
            return self._det_linear(h, self.lm_head).float()
        return self._linear(h, self.lm_head, None).float()

    def _decode_context(self, b: ForwardBatch, kv: KVCache) -> tuple[torch.Tensor, torch.Tensor] | None:
        """On the torch path, the cache slots of every decode sequence's context, computed once per
        step and shared by all layers (the Triton kernel walks the page table itself)."""
        if b.num_decode == 0 or use_triton(b.input_ids, self.attention_backend):
            return None
        nd = b.num_decode
        lens = b.seq_lens[:nd]
        return context_slots(b.page_table[:nd], lens, kv.page_size, int(lens.max()))

    def _attention(self, q, k_cache, v_cache, b: ForwardBatch,
                   ctx: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        nd = b.num_decode
        if ctx is not None and nd == b.num_seqs:
            return attend_gathered(q, k_cache.flatten(0, 1), v_cache.flatten(0, 1), ctx[0], ctx[1], self.scale)
        if nd == b.num_seqs:
            return paged_decode_attention(q, k_cache, v_cache, b.page_table, b.seq_lens, self.scale,
                                          backend=self.attention_backend)
        if nd == 0:
            return paged_extend_attention(q, k_cache, v_cache, b.page_table, b.cu_q, b.seq_lens, self.scale,
                                          backend=self.attention_backend, max_new=b.max_new,
                                          deterministic=self.deterministic)
        # decode rows come first (see ForwardBatch): one vectorised decode call, one extend call
        out = torch.empty_like(q)
        if ctx is not None:
            out[:nd] = attend_gathered(q[:nd], k_cache.flatten(0, 1), v_cache.flatten(0, 1), ctx[0], ctx[1],
                                       self.scale)
        else:
            out[:nd] = paged_decode_attention(q[:nd], k_cache, v_cache, b.page_table[:nd], b.seq_lens[:nd],
                                              self.scale, backend=self.attention_backend)
        cu = b.cu_q[nd:] - b.cu_q[nd]
        out[nd:] = paged_extend_attention(q[nd:], k_cache, v_cache, b.page_table[nd:], cu,
                                          b.seq_lens[nd:], self.scale, backend=self.attention_backend,
                                          max_new=b.max_new, deterministic=self.deterministic)
        return out
