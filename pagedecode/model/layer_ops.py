"""The ops a Llama layer is made of, one set per way of computing them, chosen once per model
(LlamaModel.ops; again when deterministic mode is switched):

    TorchOps               the reference: plain torch (the kernels' torch paths; quantized layers
                           through quant.linear, on CPU the compiled int8 kernel)
    TritonOps              the Triton kernels (CUDA, or attention_backend "triton" in the
                           interpreter): attention walks the page table itself
    DeterministicTritonOps deterministic mode there: RMSNorm one row per program, every projection
                           through kernels/matmul.py (one K order whatever the row count)
    DeterministicCpuOps    deterministic mode on CPU: the compiled det_* kernels (csrc/)

Each class overrides only the ops it computes differently, so each op's reference is the method it
overrides (TorchOps'); tests hold every set to it. The one-call compiled CPU forward
(model/cpu_forward.py) replaces the whole stack where it applies and is held to the same loop.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.nn.functional as F

from ..kernels._backend import use_triton
from ..kernels.attention_ref import attend_gathered, context_slots, flat_scales
from ..kernels.decode_attention import paged_decode_attention
from ..kernels.extend_attention import paged_extend_attention
from ..kernels.kv_write import write_kv
from ..kernels.lora import lora_delta
from ..kernels.matmul import deterministic_linear
from ..kernels.quant_matmul import quant_matmul_deterministic
from ..kernels.rmsnorm import rms_norm, rms_norm_triton
from .batch import ForwardBatch
from .kv_cache import KVCache
from .quant import QuantizedWeight, RowStack, Weight, linear

if TYPE_CHECKING:
    from ..lora.stacks import LoRABatch

# the cache slots of every decode sequence's context: (slots, lengths), computed once a step
Context = tuple[torch.Tensor, torch.Tensor] | None
# an 8-bit cache layer's (k_scale, v_scale), each (pages, page_size, kv_heads, 1); (None, None) for a
# float cache (KVCache.scales)
Scales = tuple[torch.Tensor | None, torch.Tensor | None]
NO_SCALES: Scales = (None, None)


class TorchOps:
    """The reference ops. backend: the model's attention_backend; quant_kernel: the compiled int8
    matmul for quantized layers on CPU, or None (quant.linear's other paths)."""
    name = "torch"

    def __init__(self, backend: str, scale: float, quant_kernel: Any, deterministic: bool = False) -> None:
        self.backend, self.scale, self.quant_kernel = backend, scale, quant_kernel
        self.deterministic = deterministic

    def context(self, b: ForwardBatch, kv: KVCache) -> Context:
        """The cache slots of every decode sequence's context, shared by all layers of a step."""
        if b.num_decode == 0:
            return None
        lens = b.seq_lens[:b.num_decode]
        return context_slots(b.page_table[:b.num_decode], lens, kv.page_size, int(lens.max()))

    def norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, w, eps)

    def linear(self, x: torch.Tensor, w: Weight, b: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, w, b, self.quant_kernel, self.backend)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)                              # (T, I) each
        return F.silu(gate) * up

    def lora_delta(self, x: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor, a: torch.Tensor,
                   b: torch.Tensor, scaling: torch.Tensor) -> torch.Tensor:
        """One projection's LoRA delta for the batch's rows (kernels/lora.py: shapes, segments)."""
        return lora_delta(x, seg_starts, seg_slots, a, b, scaling, backend=self.backend)

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slots: torch.Tensor, scales: Scales = NO_SCALES) -> None:
        write_kv(k_cache, v_cache, k, v, slots, backend=self.backend, k_scale=scales[0], v_scale=scales[1])

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, b: ForwardBatch,
                  ctx: Context, scales: Scales = NO_SCALES) -> torch.Tensor:
        """q (T, H, D) against one layer's pages -> (T, H, D). Decode rows come first (see
        ForwardBatch): one vectorised decode call, one extend call. scales: an 8-bit cache's."""
        nd = b.num_decode
        ks, vs = scales
        if nd == b.num_seqs:
            return self._decode(q, k_cache, v_cache, b.page_table, b.seq_lens, ctx, b.max_seq_len, scales)
        if nd == 0:
            return paged_extend_attention(q, k_cache, v_cache, b.page_table, b.cu_q, b.seq_lens, self.scale,
                                          backend=self.backend, max_new=b.max_new, deterministic=self.deterministic,
                                          k_scale=ks, v_scale=vs)
        out = torch.empty_like(q)
        out[:nd] = self._decode(q[:nd], k_cache, v_cache, b.page_table[:nd], b.seq_lens[:nd], ctx, scales=scales)
        cu = b.cu_q[nd:] - b.cu_q[nd]
        out[nd:] = paged_extend_attention(q[nd:], k_cache, v_cache, b.page_table[nd:], cu, b.seq_lens[nd:],
                                          self.scale, backend=self.backend, max_new=b.max_new,
                                          deterministic=self.deterministic, k_scale=ks, v_scale=vs)
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                seq_lens: torch.Tensor, ctx: Context, max_seq_len: int | None = None,
                scales: Scales = NO_SCALES) -> torch.Tensor:
        """max_seq_len: the batch's longest context when known without a device sync (a CUDA
        graph's static batch): the split-KV kernel sizes its splits by it."""
        if ctx is not None:
            return attend_gathered(q, k_cache.flatten(0, 1), v_cache.flatten(0, 1), ctx[0], ctx[1], self.scale,
                                   *flat_scales(*scales))
        return paged_decode_attention(q, k_cache, v_cache, page_table, seq_lens, self.scale, backend=self.backend,
                                      deterministic=self.deterministic, max_seq_len=max_seq_len,
                                      k_scale=scales[0], v_scale=scales[1])


class TritonOps(TorchOps):
    """The Triton kernels: the attention kernels walk the page table themselves (no context)."""
    name = "triton"

    def context(self, b: ForwardBatch, kv: KVCache) -> Context:
        return None


class DeterministicTritonOps(TritonOps):
    """Deterministic mode on the Triton path: RMSNorm one row per program, float projections
    through kernels/matmul.py and quantized ones through the quantized GEMM with one config for
    every row count (cuBLAS chooses its reduction by shape), attention in decode's order."""
    name = "deterministic-triton"

    def norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm_triton(x, w, eps)

    def linear(self, x: torch.Tensor, w: Weight, b: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(w, torch.Tensor):
            return deterministic_linear(x, w, b, self.backend)
        if isinstance(w, RowStack):                        # a K-quant mix: each part in its own blocks
            y = torch.cat([self.linear(x, p) for p in w.parts], dim=-1)
        else:
            y = quant_matmul_deterministic(x, w.gguf_blocks(), w.kind, self.backend)
        return y if b is None else y + b

    def lora_delta(self, x: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor, a: torch.Tensor,
                   b: torch.Tensor, scaling: torch.Tensor) -> torch.Tensor:
        return segment_by_segment(x, seg_starts, seg_slots, a, b, scaling,
                                  lambda x, w: deterministic_linear(x, w, None, self.backend))


def segment_by_segment(x: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor, a: torch.Tensor,
                       b: torch.Tensor, scaling: torch.Tensor,
                       matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The LoRA delta with each segment's shrink and expand through `matmul(x, w) = x @ w^T` of a
    deterministic mode: one order per output whatever the rows around it."""
    out = torch.zeros(x.shape[0], b.shape[1], dtype=x.dtype, device=x.device)
    starts = seg_starts.tolist()
    for g, slot in enumerate(seg_slots.tolist()):
        lo, hi = starts[g], starts[g + 1]
        if slot >= 0 and hi > lo:
            shrunk = matmul(x[lo:hi].contiguous(), a[slot])                     # (rows, R)
            # b[slot]: on the host a view of B^T's rows (lora/stacks.py), made contiguous here
            out[lo:hi] = matmul(shrunk, b[slot].contiguous()) * scaling[slot].to(x.dtype)     # (rows, N)
    return out


class DeterministicCpuOps(TorchOps):
    """Deterministic mode on CPU: the compiled kernels (csrc/cpu_forward.cpp's det_*) in place of
    every reduction (matmul, RMSNorm, attention, SiLU x up); the rest is elementwise, the same bits
    for any batch. What a tensor-parallel shard runs (its collectives sit between the ops), and any
    model the one-call forward does not take (q / k norms)."""
    name = "deterministic-cpu"

    def __init__(self, ext: Any, backend: str, scale: float, quant_kernel: Any) -> None:
        super().__init__(backend, scale, quant_kernel, deterministic=True)
        self.ext = ext
        # each float weight's det_pack copy (csrc/det_matmul.h), made on first use and kept: a
        # second copy of the float weights, as the compiled forward keeps in deterministic mode
        self.packs: dict[int, torch.Tensor] = {}

    def context(self, b: ForwardBatch, kv: KVCache) -> Context:
        return None

    def norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return self.ext.det_rms_norm(x, w, eps)

    def linear(self, x: torch.Tensor, w: Weight, b: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(w, RowStack):                          # a K-quant mix: each part in its own blocks
            y = torch.cat([self.linear(x, p) for p in w.parts], dim=-1)
            return y if b is None else y + b
        if isinstance(w, QuantizedWeight):                   # quantized blocks need no pack
            return self.ext.det_linear(x, w.kernel_blocks(), b)
        if id(w) not in self.packs:
            self.packs[id(w)] = self.ext.det_pack(w)
        return self.ext.det_linear(x, w, b, self.packs[id(w)])

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.ext.silu_mul(gate_up)

    def lora_delta(self, x: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor, a: torch.Tensor,
                   b: torch.Tensor, scaling: torch.Tensor) -> torch.Tensor:
        return segment_by_segment(x, seg_starts, seg_slots, a, b, scaling, lambda x, w: self.ext.det_linear(x, w))

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slots: torch.Tensor, scales: Scales = NO_SCALES) -> None:
        write_kv(k_cache, v_cache, k, v, slots, backend="torch", k_scale=scales[0], v_scale=scales[1])

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, b: ForwardBatch,
                  ctx: Context, scales: Scales = NO_SCALES) -> torch.Tensor:
        return self.ext.det_attention(q, k_cache, v_cache, b.page_table, b.seq_lens, b.cu_q, self.scale, False,
                                      scales[0], scales[1])


def choose_ops(device: torch.device, backend: str, scale: float, quant_kernel: Any, deterministic: bool,
               ext: Any) -> TorchOps:
    """The ops for a model on `device` with this attention_backend; ext: the compiled extension
    (deterministic mode on CPU needs it)."""
    triton = use_triton(torch.empty(0, device=device), backend)
    if not deterministic:
        return TritonOps(backend, scale, quant_kernel) if triton else TorchOps(backend, scale, quant_kernel)
    if triton:
        return DeterministicTritonOps(backend, scale, quant_kernel, deterministic=True)
    if device.type != "cpu":
        raise NotImplementedError("deterministic mode on this device: only the CPU path has its kernels here")
    if ext is None:
        raise RuntimeError("deterministic mode on CPU needs the compiled extension pagedecode._cpu (built by "
                           "setup.py with a C++ compiler)")
    return DeterministicCpuOps(ext, backend, scale, quant_kernel)


def add_lora(ops: TorchOps, lora: "LoRABatch", layer: int, x: torch.Tensor, out: torch.Tensor,
             parts: Sequence[tuple[str, int]]) -> None:
    """out += each targeted projection's LoRA delta, in place, on its columns: a fused projection
    (q | k | v, gate | up) takes each part's delta at that part's first column."""
    stacks = lora.stacks
    for proj, col in parts:
        if proj in stacks.active:
            a, b = stacks.a[layer][proj], stacks.b[layer][proj]
            out[:, col:col + b.shape[1]] += ops.lora_delta(x, lora.seg_starts, lora.seg_slots, a, b,
                                                           stacks.scaling[layer][proj])
