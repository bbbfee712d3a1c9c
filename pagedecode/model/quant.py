"""Weights kept quantized in memory: GGUF's Q8_0 and Q4_0 blocks.

One layout for both sources, so one set of kernels serves them: a GGUF file's Q8_0 / Q4_0 tensors
are kept as the file stores them, and `quantization="q8_0" | "q4_0"` quantizes a float
checkpoint's layer weights into the same blocks at load (with the `gguf` package's quantizer).

A weight (out_features, in_features) is `blocks` (out_features, in_features / 32 * block bytes)
uint8; each row is its in_features / 32 blocks in order, each block 32 consecutive inputs (an
int8 tensor of that shape is the same blocks packed, below: the dtype is the layout's tag):

    Q8_0  34 bytes   fp16 scale d | 32 x int8 q                      w[j] = d * q[j]
    Q4_0  18 bytes   fp16 scale d | 16 bytes, byte i = q[i] | q[i+16] << 4   w[j] = d * (q[j] - 8)

Three ways to multiply (`linear`): on CPU with the compiled extension, pagedecode._cpu.quant_linear
(csrc/quant_lanes.h on packed blocks, csrc/quant_matmul.h on GGUF's) quantizes the activations per block of 32 to int8 as llama.cpp does and runs integer dot
products (AVX-512 VNNI, or AVX2); on CUDA, kernels/quant_matmul.py's Triton GEMV / GEMM dequantize the
blocks in registers (float activations); otherwise (attention_backend="torch", no extension) the
weight is dequantized for the call (the reference), so the only error is the weights'. The
embedding's rows are dequantized where they are looked up (`embedding_rows`).

For the compiled CPU forward the blocks are repacked at load where the build has the packed
kernel (`pagedecode._cpu.quant_packed_kinds`: Q8_0 / Q4_0 with AVX-512 VNNI; with AVX2 also Q5_0,
Q4_1 and Q5_1; `QuantizedWeight.packed`, by pagedecode._cpu.quant_pack): 16 rows to a 512-bit
register (or two 256-bit ones), so that csrc/quant_lanes.h's kernel forms the rows' block dots at
once (3-4x the GGUF-layout kernel's multiply-adds a second with VNNI; with AVX2, 4- and 64-token
GEMMs of SmolLM2's shapes measured 1.4-2.3x). Same size, same blocks, int8 instead of uint8;
`gguf_blocks()` gives GGUF's layout back, bit for bit.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..kernels.quant_matmul import BLOCK, BLOCK_BYTES, dequantize_blocks, quant_matmul
from ..kernels.quant_types import BLOCK_TYPES, KINDS

# what `quantization=` applies to a float checkpoint (gguf's reference quantizer has these; the
# K-quants come from files)
QUANTIZATIONS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
# the compiled CPU kernels' packed layout (csrc/quant_lanes.h) takes these (which of them the build
# has a fast kernel for, and so packs at load: pagedecode._cpu.quant_packed_kinds)
PACKABLE = (*BLOCK_BYTES, "q5_0", "q4_1", "q5_1")


def _cpu_ext() -> Any:
    """pagedecode._cpu, which made any packed weight (so it is there when one exists)."""
    from .. import _cpu
    return _cpu


class QuantizedWeight:
    """A (out_features, in_features) weight in one GGUF block type's blocks (kernels/quant_types.py;
    Q8_0 / Q4_0 / Q5_0 / Q4_1 / Q5_1 also packed, see the module docstring)."""

    def __init__(self, kind: str, blocks: torch.Tensor, shape: tuple[int, int]) -> None:
        if kind not in BLOCK_TYPES:
            raise ValueError(f"block type must be one of {KINDS}, got {kind!r}")
        out_features, in_features = shape
        block, type_size = BLOCK_TYPES[kind]
        if in_features % block or blocks.dtype not in (torch.uint8, torch.int8) or \
                (blocks.dtype == torch.int8 and kind not in PACKABLE) or \
                tuple(blocks.shape) != (out_features, in_features // block * type_size):
            raise ValueError(f"{kind} blocks {tuple(blocks.shape)} {blocks.dtype} do not hold a {shape} weight")
        self.kind = kind
        self.blocks = blocks.contiguous()       # uint8: GGUF's layout; int8: packed (csrc/quant_lanes.h)
        self.shape = (int(out_features), int(in_features))

    @property
    def packed(self) -> bool:
        return self.blocks.dtype == torch.int8

    def pack(self) -> "QuantizedWeight":
        """The same weight in the compiled CPU kernel's packed layout (needs pagedecode._cpu)."""
        if self.packed or self.kind not in PACKABLE:
            return self
        return QuantizedWeight(self.kind, _cpu_ext().quant_pack(self.blocks, self.shape[1]), self.shape)

    def gguf_blocks(self) -> torch.Tensor:
        """The blocks in GGUF's layout (unpacked for the call when packed)."""
        if not self.packed:
            return self.blocks
        return _cpu_ext().quant_unpack(self.blocks, self.shape[1])

    @classmethod
    def quantize(cls, w: torch.Tensor, kind: str) -> "QuantizedWeight":
        """w (out, in) float, in a multiple of 32 -> blocks, by gguf's reference quantizer (which
        llama.cpp's quantize_row_*_ref are; kind one of QUANTIZATIONS)."""
        import gguf
        if kind not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {kind!r}")
        qtype = gguf.GGMLQuantizationType[kind.upper()]
        data = gguf.quants.quantize(w.detach().float().cpu().numpy(), qtype)
        return cls(kind, torch.from_numpy(np.ascontiguousarray(data)).to(w.device),
                   (int(w.shape[0]), int(w.shape[1])))

    @classmethod
    def cat(cls, parts: Sequence["QuantizedWeight"]) -> "QuantizedWeight":
        """Stack weights of one kind along the output rows (q, k, v -> qkv)."""
        kind, in_features = parts[0].kind, parts[0].shape[1]
        assert all(p.kind == kind and p.shape[1] == in_features for p in parts)
        return cls(kind, torch.cat([p.gguf_blocks() for p in parts]), (sum(p.shape[0] for p in parts), in_features))

    def kernel_blocks(self) -> torch.Tensor:
        """The blocks as the compiled CPU kernels take them: Q8_0 / Q4_0 (N, row bytes) in either
        layout and the other packed types, whose block size says the type; every other type (N, blocks per
        row, type size), a view, whose block count and size say the type (csrc/quant_types.h)."""
        if self.kind in BLOCK_BYTES or self.packed:
            return self.blocks
        return self.blocks.view(self.shape[0], -1, BLOCK_TYPES[self.kind].type_size)

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def to(self, device: torch.device | str) -> "QuantizedWeight":
        return QuantizedWeight(self.kind, self.gguf_blocks().to(device), self.shape)

    def select_rows(self, index: torch.Tensor) -> "QuantizedWeight":
        return QuantizedWeight(self.kind, self.gguf_blocks()[index], (int(index.numel()), self.shape[1]))

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weight (out, in) in `dtype`, or only `rows` of it (len(rows), in)."""
        if self.packed and rows is not None:            # the rows alone, not the whole table unpacked
            flat = _cpu_ext().quant_embedding_rows(self.blocks, rows.reshape(-1).long(), self.shape[1])
            return flat.view(*rows.shape, self.shape[1]).to(dtype)
        blocks = self.gguf_blocks()
        return dequantize_blocks(blocks if rows is None else blocks[rows], self.kind, dtype)


class RowStack:
    """Quantized weights of different block types stacked along the output rows, each kept in its
    own blocks and multiplied on its own: q, k, v of a K-quant mix (llama.cpp's Q4_K_M gives
    attn_v more bits than attn_q and attn_k). The compiled one-call forward takes it as its parts
    (model/cpu_forward.py parts(): q_w, k_w, v_w or gate_w, up_w), each part's matmul the one the
    torch path makes for it here (linear)."""

    kind = "mixed"

    def __init__(self, parts: Sequence["QuantizedWeight"]) -> None:
        assert len({p.shape[1] for p in parts}) == 1
        self.parts = list(parts)
        self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    def to(self, device: torch.device | str) -> "RowStack":
        return RowStack([p.to(device) for p in self.parts])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) for p in self.parts])


Weight = torch.Tensor | QuantizedWeight | RowStack


def block_kinds(w: Weight) -> set[str]:
    """The block types a weight is held in: a RowStack's parts', none for a float weight."""
    if isinstance(w, RowStack):
        return {p.kind for p in w.parts}
    return {w.kind} if isinstance(w, QuantizedWeight) else set()


def compiled_kinds() -> tuple[str, ...]:
    """The block types this build's compiled kernels multiply (quant_linear, the compiled forward):
    Q8_0 / Q4_0 in every build that has quant_linear, the rest where it says so."""
    try:
        from .. import _cpu
    except ImportError:
        return ()
    if not hasattr(_cpu, "quant_linear"):
        return ()
    return tuple(dict.fromkeys((*BLOCK_BYTES, *getattr(_cpu, "quant_block_kinds", ()))))


QuantKernel = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


def linear(x: torch.Tensor, w: Weight, b: torch.Tensor | None = None, kernel: QuantKernel | None = None,
           backend: str = "auto") -> torch.Tensor:
    """F.linear over a float or a quantized weight. A quantized weight goes to `kernel`
    (pagedecode._cpu.quant_linear: int8 activations, either layout) when given, else to
    kernels/quant_matmul.py (float activations): its Triton kernels on CUDA, or where `backend`
    asks for them; the reference (the weight dequantized for this call) otherwise."""
    if isinstance(w, RowStack):
        y = torch.cat([linear(x, p, None, kernel, backend) for p in w.parts], dim=-1)
        return y if b is None else y + b
    if not isinstance(w, QuantizedWeight):
        return F.linear(x, w, b)
    if kernel is None or w.kind not in compiled_kinds():
        y = quant_matmul(x, w.gguf_blocks(), w.kind, backend)
        return y if b is None else y + b
    y = kernel(x.reshape(-1, w.shape[1]).float().contiguous(), w.kernel_blocks(), w.shape[0])    # (T, out) float32
    y = y.view(*x.shape[:-1], w.shape[0]).to(x.dtype)
    return y if b is None else y + b


def embedding_rows(table: Weight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(table, QuantizedWeight):
        return table.dequantize(dtype, rows=ids)
    assert isinstance(table, torch.Tensor)
    return table[ids]


def cat_rows(parts: Sequence[Weight], dtype: torch.dtype) -> Weight:
    """q, k, v (or gate, up) stacked: in one kind's blocks when all share it, each in its own
    blocks when all are quantized (RowStack), else in float; always a copy (never a view of the
    parts, which may be a file's mapping)."""
    quantized = [p for p in parts if isinstance(p, QuantizedWeight)]
    if len(quantized) == len(parts) and len({p.kind for p in quantized}) == 1:
        return QuantizedWeight.cat(quantized)
    if len(quantized) == len(parts):
        return RowStack([QuantizedWeight.cat([p]) for p in quantized])
    return torch.cat([p if isinstance(p, torch.Tensor) else p.dequantize(dtype) for p in parts], 0)


def weight_bytes(w: Weight | None) -> int:
    if w is None:
        return 0
    if isinstance(w, (QuantizedWeight, RowStack)):
        return w.nbytes
    return w.numel() * w.element_size()
