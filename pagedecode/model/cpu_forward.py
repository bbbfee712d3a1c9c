"""The compiled CPU forward's side of a Llama model (csrc/cpu_forward.cpp, `pagedecode._cpu`):
whether this install has it, the engine's switches for it (EngineConfig.cpu_*), and
CompiledForward -- the flat list of weights the one-call forward takes, their packed copies
(oneDNN's blocked layout, or det_pack's in deterministic mode), and the call itself."""
from __future__ import annotations

import os
import types
from typing import Any, Sequence

import torch

from .batch import ForwardBatch
from .config import ModelConfig
from .kv_cache import KVCache
from .quant import QuantizedWeight, Weight, compiled_kinds

_cpu_ext: types.ModuleType | None
try:  # csrc/cpu_forward.cpp, built by setup.py when a compiler is present
    from .. import _cpu as _cpu_ext
except ImportError:  # pragma: no cover - depends on the install
    _cpu_ext = None
# builds before EngineConfig.cpu_matmul read PAGEDECODE_CPU_MATMUL themselves; newer ones take the
# choice as forward's last argument
_TAKES_MATMUL_CHOICE = bool(getattr(_cpu_ext, "takes_matmul_choice", False))
_TAKES_DETERMINISTIC = bool(getattr(_cpu_ext, "takes_deterministic", False))
# builds before EngineConfig.kv_cache_dtype take only a cache of the model's own dtype
_TAKES_KV_CACHE_DTYPE = bool(getattr(_cpu_ext, "takes_kv_cache_dtype", False))

# weights of at most this many elements also go to the compiled forward transposed (small_t)
SMALL_LAYER = 1 << 16


def default_cpu_matmul() -> str:
    """EngineConfig.cpu_matmul's default: "aten" when PAGEDECODE_CPU_MATMUL=aten, else "onednn"."""
    return "aten" if os.environ.get("PAGEDECODE_CPU_MATMUL") == "aten" else "onednn"


def default_cpu_pack_weights() -> bool:
    """EngineConfig.cpu_pack_weights' default: True unless PAGEDECODE_CPU_PACK=0."""
    return os.environ.get("PAGEDECODE_CPU_PACK") != "0"


def keep_freed_memory() -> bool:
    """glibc's malloc keeps freed blocks for reuse (csrc/cpu_forward.cpp keep_freed_memory: once
    per process, idempotent); False without the compiled extension or off glibc."""
    return bool(_cpu_ext.keep_freed_memory()) if _cpu_ext is not None else False


def configure_cpu_forward(model: object, matmul: str, pack_weights: bool, keep_freed: bool) -> None:
    """What an engine asks of the compiled CPU forward (EngineConfig.cpu_*): the model's matmuls
    and packed weights (any model with `configure_cpu`), and glibc's malloc setting when the
    model runs that forward (applied here, by the engine, never by a model's constructor)."""
    configure = getattr(model, "configure_cpu", None)
    if callable(configure):
        configure(matmul, pack_weights)
    uses = getattr(model, "uses_cpu_extension", None)
    if keep_freed and callable(uses) and uses():
        keep_freed_memory()


def cpu_extension_available() -> bool:
    return _cpu_ext is not None


def deterministic_ext(device: torch.device) -> types.ModuleType:
    """The compiled kernels deterministic mode runs on CPU (csrc/cpu_forward.cpp's det_*)."""
    if device.type != "cpu":
        raise NotImplementedError("deterministic mode on this device: only the CPU path has its kernels here")
    if _cpu_ext is None or not _TAKES_DETERMINISTIC:
        raise RuntimeError("deterministic mode on CPU needs the compiled extension pagedecode._cpu (built by "
                           "setup.py with a C++ compiler); this install has none or an older build")
    return _cpu_ext


def plain(w: Weight) -> torch.Tensor:
    """What the compiled kernels take: a float weight, or a quantized one's blocks."""
    if isinstance(w, QuantizedWeight):
        return w.kernel_blocks()
    assert isinstance(w, torch.Tensor), "a RowStack runs the torch path (model/quant.py)"
    return w


def quant_kernel(device: torch.device, attention_backend: str) -> Any:
    """The compiled int8 matmul (quant_linear) for quantized layers on CPU, unless "torch" asks for
    the dequantizing reference; None on CUDA (kernels/quant_matmul.py's Triton GEMV / GEMM) or with
    an older build."""
    return getattr(_cpu_ext, "quant_linear", None) if device.type == "cpu" and attention_backend == "auto" else None


def applies(config: ModelConfig, device: torch.device, dtype: torch.dtype, kinds: set[str]) -> bool:
    """The one-call forward takes float32 / bfloat16 Llama shapes on CPU without q / k norms, and
    quantized weights (of block types `kinds`) only with a build that has their kernels."""
    return (_cpu_ext is not None and device.type == "cpu" and not config.qk_norm
            and dtype in (torch.float32, torch.bfloat16)
            and (not kinds or (hasattr(_cpu_ext, "quant_embedding_rows") and kinds <= set(compiled_kinds()))))


def pack_quantized(model: Any) -> None:
    """Every quantized weight of `model` in the compiled kernel's packed layout (csrc/quant_lanes.h:
    the same bytes rearranged, the GGUF-layout blocks dropped; a tied head stays the embedding), where
    this build's packed kernel is the fast one (AVX-512 VNNI)."""
    if not getattr(_cpu_ext, "quant_packed_is_fast", False):
        return

    def packed(w: Any) -> Any:
        return w.pack() if isinstance(w, QuantizedWeight) else w
    tied = model.lm_head is model.embed
    model.embed = packed(model.embed)
    model.lm_head = model.embed if tied else packed(model.lm_head)
    for L in model.layers:
        L.qkv_w, L.o_w, L.gate_up_w, L.down_w = (packed(w) for w in (L.qkv_w, L.o_w, L.gate_up_w, L.down_w))


class CompiledForward:
    """A model's weights as pagedecode._cpu.forward takes them, and the call.

    layers: the model's layers (ln1, ln2, qkv_w, qkv_b, o_w, o_b, gate_up_w, down_w each). The flat
    list holds, per layer, in forward_impl's order: ln1, qkv_w, qkv_b, o_w, o_b, ln2, gate_up_w,
    down_w (float or quantized blocks), the four weights transposed for small layers (gemv over
    outputs), and the four packed copies of the running mode (empty tensors where absent)."""

    def __init__(self, config: ModelConfig, layers: Sequence[Any], embed: Weight, lm_head: Weight,
                 final_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype,
                 scale: float, quantized: bool) -> None:
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

        self.flat_layers = [t for L in layers for t in (
            L.ln1, plain(L.qkv_w), none if L.qkv_b is None else L.qkv_b, plain(L.o_w),
            none if L.o_b is None else L.o_b, L.ln2, plain(L.gate_up_w), plain(L.down_w),
            small_t(L.qkv_w), small_t(L.o_w), small_t(L.gate_up_w), small_t(L.down_w),
            none, none, none, none)]         # the packed copies: _pack
        self.embed_plain = plain(embed)
        self.lm_head_plain = plain(lm_head)
        self.lm_head_t = small_t(lm_head)
        self.lm_head_packed = none
        self.cos32, self.sin32 = cos.float().contiguous(), sin.float().contiguous()
        # held here: at interpreter exit the module's attributes may be gone before __del__ runs
        self._quiesce = getattr(_cpu_ext, "quiesce", None) if quantized else None

    def configure(self, matmul: str, pack_weights: bool) -> None:
        """LlamaModel.configure_cpu's effect: oneDNN or at::mm for the larger matmuls, and whether
        the packed copies are kept."""
        if matmul == "aten" and not _TAKES_MATMUL_CHOICE and default_cpu_matmul() != "aten":   # it reads the env
            raise RuntimeError("this build of pagedecode._cpu predates the matmul choice: rebuild it "
                               "(make install) to use cpu_matmul='aten'")
        self.onednn = matmul == "onednn"
        self.pack_weights = pack_weights
        self._pack()

    def set_deterministic(self, on: bool) -> None:
        self.deterministic = on
        self._pack()            # the packed copies the mode's matmul reads

    def _pack(self) -> None:
        """The packed weight copies for the mode that runs: det_pack's layout in deterministic
        mode, oneDNN's otherwise (one copy at a time, swapped when the mode changes)."""
        if self.deterministic:
            kind = "det" if self.pack_weights and hasattr(_cpu_ext, "det_pack") else None
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

        for i, L in enumerate(self.layers):    # each layer's last four entries (see forward_impl)
            self.flat_layers[16 * i + 12:16 * i + 16] = [packed(L.qkv_w), packed(L.o_w), packed(L.gate_up_w),
                                                         packed(L.down_w)]
        self.lm_head_packed = packed(self.lm_head)
        self.packed_kind = kind

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the call reads beyond the model's own weights' (for weight_bytes)."""
        return self.flat_layers + [self.lm_head_t, self.lm_head_packed]

    def runs(self, kv: KVCache) -> bool:
        """Whether forward() takes this batch's cache: the model's dtype, or for a float32 model a
        bfloat16 / float16 one (kv_cache_dtype); deterministic mode only with a build that has its
        kernels."""
        narrower = (torch.bfloat16, torch.float16) if self.dtype == torch.float32 and _TAKES_KV_CACHE_DTYPE else ()
        takes = (self.dtype, *narrower)
        return kv.k.dtype in takes and (_TAKES_DETERMINISTIC or not self.deterministic)

    def forward(self, b: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Logits (N, vocab) float32 of the batch's logits rows, its K/V written into kv."""
        assert _cpu_ext is not None
        c = self.config
        return _cpu_ext.forward(b.input_ids, b.positions, b.slot_mapping, b.page_table, b.seq_lens, b.cu_q,
                                b.logits_indices, self.embed_plain, self.final_norm, self.lm_head_plain,
                                self.lm_head_t, self.lm_head_packed, self.cos32, self.sin32, self.flat_layers,
                                kv.k, kv.v, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps, self.scale,
                                *((self.onednn, self.deterministic) if _TAKES_DETERMINISTIC else
                                  (self.onednn,) if _TAKES_MATMUL_CHOICE else ()))

    def __del__(self) -> None:
        # the compiled quantized matmuls' workers may still be finishing a row of a chunk the
        # caller took back (csrc/work_pool.h): the blocks this holds are freed only once none is
        quiesce = getattr(self, "_quiesce", None)
        if quiesce is not None:
            quiesce()
