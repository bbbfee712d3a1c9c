"""The compiled CPU forward's side of a Llama model (csrc/cpu_forward.cpp, `pagedecode._cpu`):
whether this install has it, the engine's switches for it (EngineConfig.cpu_*), and
CompiledForward -- each layer's tensors by the slot names the extension declares, their packed
copies (oneDNN's blocked layout, or det_pack's in deterministic mode), and the call itself."""
from __future__ import annotations

import types
from typing import Any, Sequence

import torch

from ..lora.adapter import PROJECTIONS
from .batch import ForwardBatch
from .config import ModelConfig
from .kv_cache import KVCache
from .quant import QuantizedWeight, RowStack, Weight, compiled_kinds

_cpu_ext: types.ModuleType | None
try:  # csrc/cpu_forward.cpp, built by setup.py when a compiler is present
    from .. import _cpu as _cpu_ext
except ImportError:  # pragma: no cover - depends on the install
    _cpu_ext = None

# What CompiledForward puts in each slot of a layer (csrc/cpu_forward.cpp's Slot). The extension
# takes each layer as a list in its own order, by these names; a build whose names differ is from
# another version of csrc/ (the install rebuilds it).
LAYER_SLOTS = frozenset({"ln1", "qkv_w", "qkv_b", "o_w", "o_b", "ln2", "gate_up_w", "down_w",
                         "qkv_t", "o_t", "gate_up_t", "down_t",
                         "qkv_packed", "o_packed", "gate_up_packed", "down_packed",
                         "q_w", "k_w", "v_w", "gate_w", "up_w"})
# a stacked projection held as a RowStack (a K-quant mix: parts of different block types) goes to
# the extension as its parts, its own slot empty
PART_SLOTS = {"qkv_w": ("q_w", "k_w", "v_w"), "gate_up_w": ("gate_w", "up_w")}
if _cpu_ext is not None and set(getattr(_cpu_ext, "layer_slots", lambda: ())()) != LAYER_SLOTS:
    raise ImportError(f"pagedecode._cpu at {_cpu_ext.__file__} is from another version of csrc/ (its layer "
                      "slots differ from model/cpu_forward.py's): rebuild it (make install, or "
                      "python setup.py build_ext --inplace)")

# weights of at most this many elements also go to the compiled forward transposed (small_t)
SMALL_LAYER = 1 << 16


def keep_freed_memory() -> bool:
    """glibc's malloc keeps freed blocks for reuse (csrc/cpu_forward.cpp keep_freed_memory: once
    per process, idempotent); False without the compiled extension or off glibc."""
    return bool(_cpu_ext.keep_freed_memory()) if _cpu_ext is not None else False


def cpu_extension_available() -> bool:
    return _cpu_ext is not None


def cpu_ext() -> types.ModuleType | None:
    """The compiled extension, or None (read at call time: a test switches it off)."""
    return _cpu_ext


def onednn_bf16_supported() -> bool:
    """Whether oneDNN runs bfloat16 matmuls on this CPU."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else torch.backends.mkldnn.is_available()


def lora_stack(layers: list[list[torch.Tensor]], ranks: torch.Tensor) -> Any:
    """The extension's LoraStack over lora/stacks.py's buffers: each layer's [A, B^T, scaling] per
    projection, in the order the extension names them (lora_projections()), and each slot's rank."""
    assert _cpu_ext is not None
    if tuple(_cpu_ext.lora_projections()) != PROJECTIONS:
        raise RuntimeError(f"pagedecode._cpu at {_cpu_ext.__file__} names the LoRA projections "
                           f"{_cpu_ext.lora_projections()}, not {PROJECTIONS}: rebuild it")
    return _cpu_ext.LoraStack(layers, ranks)


def takes_lora() -> bool:
    """Whether this build's forward adds LoRA deltas (an older build: LoRA batches take the torch path)."""
    return _cpu_ext is not None and hasattr(_cpu_ext, "LoraStack")


def plain(w: Weight) -> torch.Tensor:
    """What the compiled kernels take: a float weight, or a quantized one's blocks (a RowStack goes
    as its parts: parts())."""
    if isinstance(w, QuantizedWeight):
        return w.kernel_blocks()
    assert isinstance(w, torch.Tensor), "a RowStack goes to the compiled forward as its parts (parts())"
    return w


def parts(slot: str, w: Weight, none: torch.Tensor) -> dict[str, torch.Tensor]:
    """A stacked projection's slots: `slot` its blocks (or float weight) and its part slots empty, or
    for a RowStack `slot` empty and each part's blocks in its part slot (the extension multiplies
    each in its own type into its columns and checks each part's rows against the heads and sizes)."""
    names = PART_SLOTS.get(slot, ())
    if not isinstance(w, RowStack):
        return {slot: plain(w), **{n: none for n in names}}
    if len(w.parts) != len(names):
        raise ValueError(f"{slot} is stacked from {len(w.parts)} parts; the compiled forward takes {names}")
    return {slot: none, **{n: p.kernel_blocks() for n, p in zip(names, w.parts)}}


def quant_kernel(device: torch.device, attention_backend: str) -> Any:
    """The compiled int8 matmul (quant_linear) for quantized layers on CPU, unless "torch" asks for
    the dequantizing reference; None on CUDA (kernels/quant_matmul.py's Triton GEMV / GEMM) or without
    the extension."""
    if _cpu_ext is None or device.type != "cpu" or attention_backend != "auto":
        return None
    return _cpu_ext.quant_linear


def applies(config: ModelConfig, device: torch.device, dtype: torch.dtype, kinds: set[str]) -> bool:
    """The one-call forward takes float32 / bfloat16 Llama shapes on CPU without q / k norms, and
    quantized weights (of block types `kinds`) only with a build that has their kernels."""
    return (_cpu_ext is not None and device.type == "cpu" and not config.qk_norm
            and dtype in (torch.float32, torch.bfloat16)
            and (not kinds or (hasattr(_cpu_ext, "quant_embedding_rows") and kinds <= set(compiled_kinds()))))


def pack_quantized(model: Any) -> None:
    """Every quantized weight of `model` in the compiled kernel's packed layout (csrc/quant_lanes.h:
    the same bytes rearranged, the GGUF-layout blocks dropped; a tied head stays the embedding), where
    this build's packed kernel is the fast one (`pagedecode._cpu.quant_packed_kinds`)."""
    fast = set(getattr(_cpu_ext, "quant_packed_kinds", ())) if _cpu_ext is not None else set()
    if not fast:
        return

    def packed(w: Any) -> Any:
        if isinstance(w, RowStack):
            return RowStack([packed(p) for p in w.parts])
        return w.pack() if isinstance(w, QuantizedWeight) and w.kind in fast else w
    tied = model.lm_head is model.embed
    model.embed = packed(model.embed)
    model.lm_head = model.embed if tied else packed(model.lm_head)
    for L in model.layers:
        L.qkv_w, L.o_w, L.gate_up_w, L.down_w = (packed(w) for w in (L.qkv_w, L.o_w, L.gate_up_w, L.down_w))


class CompiledForward:
    """A model's weights as pagedecode._cpu.forward takes them (a _cpu.Stack, which checks every
    shape once), and the call.

    layers: the model's layers (ln1, ln2, qkv_w, qkv_b, o_w, o_b, gate_up_w, down_w each). Each
    layer's slots (LAYER_SLOTS): those, the four weights transposed for small layers (gemv over
    outputs), the four packed copies of the running mode, and a RowStack's parts (parts()); empty
    tensors where absent."""

    def __init__(self, config: ModelConfig, layers: Sequence[Any], embed: Weight, lm_head: Weight,
                 final_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype,
                 scale: float) -> None:
        assert _cpu_ext is not None
        self.config, self.layers, self.lm_head, self.final_norm = config, layers, lm_head, final_norm
        self.dtype, self.scale = dtype, scale
        self.onednn = True
        self.pack_weights = False
        self.deterministic = False
        self.packed_kind: str | None = None        # what the packed slots hold: "onednn", "det" or nothing
        none = torch.empty(0, dtype=dtype)

        def small_t(w: Weight) -> torch.Tensor:
            """A small layer's weight transposed, for the compiled gemv over outputs (a 64-wide
            layer spends most of a dot product per output in its horizontal sum)."""
            if not isinstance(w, torch.Tensor):
                return none
            return w.t().contiguous() if w.numel() <= SMALL_LAYER else none

        self.layer_slots: list[dict[str, torch.Tensor]] = [{
            "ln1": L.ln1, **parts("qkv_w", L.qkv_w, none), "qkv_b": none if L.qkv_b is None else L.qkv_b,
            "o_w": plain(L.o_w), "o_b": none if L.o_b is None else L.o_b, "ln2": L.ln2,
            **parts("gate_up_w", L.gate_up_w, none), "down_w": plain(L.down_w),
            "qkv_t": small_t(L.qkv_w), "o_t": small_t(L.o_w), "gate_up_t": small_t(L.gate_up_w),
            "down_t": small_t(L.down_w),
            "qkv_packed": none, "o_packed": none, "gate_up_packed": none, "down_packed": none,   # _pack's
        } for L in layers]
        self.embed_plain = plain(embed)
        self.lm_head_plain = plain(lm_head)
        self.lm_head_t = small_t(lm_head)
        self.lm_head_packed = none
        self.cos32, self.sin32 = cos.float().contiguous(), sin.float().contiguous()
        self.stack = self._stack()

    def set_rope(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Grown RoPE tables (LlamaModel._cover_positions): the Stack is rebuilt over them."""
        self.cos32, self.sin32 = cos.float().contiguous(), sin.float().contiguous()
        self.stack = self._stack()

    def _stack(self) -> Any:
        """The extension's view of the weights: each layer's slots in its order, every shape checked."""
        assert _cpu_ext is not None
        c, order = self.config, _cpu_ext.layer_slots()
        return _cpu_ext.Stack([[slots[name] for name in order] for slots in self.layer_slots], self.embed_plain,
                              self.final_norm, self.lm_head_plain, self.lm_head_t, self.lm_head_packed,
                              self.cos32, self.sin32, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps,
                              self.scale)

    def configure(self, matmul: str, pack_weights: bool) -> None:
        """LlamaModel.configure_cpu's effect: oneDNN or at::mm for the larger matmuls, and whether
        the packed copies are kept."""
        # oneDNN's bfloat16 matmul needs the CPU's bf16 support (AVX-512 BF16 / AMX): without it
        # it cannot create its primitive, so a bfloat16 model takes at::mm there
        self.onednn = matmul == "onednn" and (self.dtype != torch.bfloat16 or onednn_bf16_supported())
        self.pack_weights = pack_weights
        self._pack()

    def set_deterministic(self, on: bool) -> None:
        self.deterministic = on
        self._pack()            # the packed copies the mode's matmul reads

    def _pack(self) -> None:
        """The packed weight copies for the mode that runs: det_pack's layout in deterministic
        mode, oneDNN's otherwise (one copy at a time, swapped when the mode changes)."""
        if self.deterministic:
            kind = "det" if self.pack_weights else None
        else:
            kind = "onednn" if self.onednn and self.pack_weights and torch.backends.mkldnn.is_available() else None
        if kind == self.packed_kind:
            return
        none = torch.empty(0, dtype=self.dtype)

        def packed(w: Weight) -> torch.Tensor:
            if kind is None or not isinstance(w, torch.Tensor):
                return none
            if kind == "det":
                assert _cpu_ext is not None
                return _cpu_ext.det_pack(w)
            try:
                return torch.ops.mkldnn._reorder_linear_weight(w, 64)
            except (RuntimeError, AttributeError):      # a torch without the op: plain weights
                return none

        for L, slots in zip(self.layers, self.layer_slots):
            slots.update(qkv_packed=packed(L.qkv_w), o_packed=packed(L.o_w), gate_up_packed=packed(L.gate_up_w),
                         down_packed=packed(L.down_w))
        self.lm_head_packed = packed(self.lm_head)
        self.packed_kind = kind
        self.stack = self._stack()

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the call reads beyond the model's own weights' (for weight_bytes)."""
        return [t for slots in self.layer_slots for t in slots.values()] + [self.lm_head_t, self.lm_head_packed]

    def runs(self, kv: KVCache) -> bool:
        """Whether forward() takes this batch's cache: the model's dtype, or for a float32 model a
        bfloat16 / float16 one, or an 8-bit one with its scales (kv_cache_dtype)."""
        narrower = (torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn) if self.dtype == torch.float32 else ()
        return kv.k.dtype in (self.dtype, *narrower)

    def forward(self, b: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Logits (N, vocab) float32 of the batch's logits rows, its K/V written into kv; a batch
        with LoRA adapters (b.lora) adds each row's deltas in the call (csrc/lora_delta.h)."""
        assert _cpu_ext is not None
        # an 8-bit cache's scales, else None
        if b.lora is None:
            return _cpu_ext.forward(self.stack, b.input_ids, b.positions, b.slot_mapping, b.page_table, b.seq_lens,
                                    b.cu_q, b.logits_indices, kv.k, kv.v, self.onednn, self.deterministic,
                                    k_scale=kv.k_scale, v_scale=kv.v_scale)
        return _cpu_ext.forward(self.stack, b.input_ids, b.positions, b.slot_mapping, b.page_table, b.seq_lens,
                                b.cu_q, b.logits_indices, kv.k, kv.v, self.onednn, self.deterministic,
                                lora=b.lora.stacks.compiled_view(lora_stack), seg_starts=b.lora.seg_starts,
                                seg_slots=b.lora.seg_slots, k_scale=kv.k_scale, v_scale=kv.v_scale)
