"""A GGUF file's metadata and tensor table, read with every count bounded by the file's size.

The layout (little-endian), as llama.cpp's gguf.h writes it:

    b"GGUF" | version u32 | tensor count u64 | metadata count u64
    metadata:      key (string) | value type u32 | value                  (metadata count times)
    tensor table:  name (string) | n_dims u32 | dims u64 x n_dims | type u32 | offset u64
    padding up to general.alignment (32 unless set), then the tensors' data, each at its offset

A string is a u64 byte length and that many UTF-8 bytes; an array an item type u32, a count u64
and the items. Every count and length is checked against the bytes left before anything is
allocated or looped over, so a hostile or cut-short file fails at once in one line ("truncated at
byte N: ... declares N items, which need ...") instead of reading, allocating or looping for what
the file does not hold. The file is memory-mapped, privately (copy-on-write: the views are
writable numpy arrays that torch takes as they are, and nothing ever writes the file): a numeric
array or a tensor's data is a view, read when used, never copied here; string arrays are decoded in
one tight loop (a tokenizer's vocabulary is one). The mapping lives as long as a view of it does.
"""
from __future__ import annotations

import enum
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ModelLoadError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4                          # GGML_MAX_DIMS
STRING, ARRAY = 8, 9
# value type -> little-endian struct / numpy format of the fixed-size types
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
# the fewest bytes one item of an array of that type takes, to bound a count before reading it
MIN_ITEM_BYTES = {**{k: struct.calcsize(f) for k, f in SCALARS.items()}, STRING: 8, ARRAY: 12}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


class GGMLType(enum.IntEnum):
    """ggml's tensor types (ggml.h's ggml_type; gguf.GGMLQuantizationType has the same values and
    names, and compares equal): listed here because importing the `gguf` package builds every
    enum of its constants, ~0.1 s of a load, for the few types a file holds."""
    F32, F16, Q4_0, Q4_1 = 0, 1, 2, 3
    Q5_0, Q5_1, Q8_0, Q8_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K = range(6, 16)
    IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ4_NL, IQ3_S, IQ2_S, IQ4_XS = range(16, 24)
    I8, I16, I32, I64, F64, IQ1_M, BF16 = range(24, 31)
    TQ1_0, TQ2_0 = 34, 35
    MXFP4, NVFP4, Q1_0, Q2_0 = 39, 40, 41, 42


# (inputs per block, bytes per block) of each type, as gguf.GGML_QUANT_SIZES has them
QUANT_SIZES = {
    GGMLType.F32: (1, 4), GGMLType.F16: (1, 2), GGMLType.Q4_0: (32, 18), GGMLType.Q4_1: (32, 20),
    GGMLType.Q5_0: (32, 22), GGMLType.Q5_1: (32, 24), GGMLType.Q8_0: (32, 34), GGMLType.Q8_1: (32, 36),
    GGMLType.Q2_K: (256, 84), GGMLType.Q3_K: (256, 110), GGMLType.Q4_K: (256, 144), GGMLType.Q5_K: (256, 176),
    GGMLType.Q6_K: (256, 210), GGMLType.Q8_K: (256, 292), GGMLType.IQ2_XXS: (256, 66), GGMLType.IQ2_XS: (256, 74),
    GGMLType.IQ3_XXS: (256, 98), GGMLType.IQ1_S: (256, 50), GGMLType.IQ4_NL: (32, 18), GGMLType.IQ3_S: (256, 110),
    GGMLType.IQ2_S: (256, 82), GGMLType.IQ4_XS: (256, 136), GGMLType.I8: (1, 1), GGMLType.I16: (1, 2),
    GGMLType.I32: (1, 4), GGMLType.I64: (1, 8), GGMLType.F64: (1, 8), GGMLType.IQ1_M: (256, 56),
    GGMLType.BF16: (1, 2), GGMLType.TQ1_0: (256, 54), GGMLType.TQ2_0: (256, 66), GGMLType.MXFP4: (32, 17),
    GGMLType.NVFP4: (64, 36), GGMLType.Q1_0: (128, 18), GGMLType.Q2_0: (64, 18),
}
# tensor types whose data GGUFReader (and read_tensor) sees as elements, not bytes
ELEMENT_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                  "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the table, with the attributes of gguf's ReaderTensor that loading reads."""
    name: str
    tensor_type: GGMLType             # equal to gguf.GGMLQuantizationType's member
    shape: tuple[int, ...]            # GGUF's order: the fastest dimension first
    data: np.ndarray                  # a view of the mapped file: elements, or bytes (rows, bytes per row)
    data_offset: int
    n_bytes: int


@dataclass(frozen=True)
class GGUFContents:
    metadata: dict[str, Any]          # key -> int / float / bool / str, list[str], or a numpy array
    tensors: dict[str, GGUFTensor]    # in the file's order
    version: int


class _Cursor:
    """Reads forward through the mapped file; every read checks the bytes are there."""

    def __init__(self, path: Path, buf: mmap.mmap) -> None:
        self.path, self.buf, self.size, self.pos = path, buf, len(buf), 0

    def need(self, n: int, what: str) -> int:
        """The position of `n` bytes for `what`, then advances past them; or the truncation error."""
        start = self.pos
        if n > self.size - start:
            raise ModelLoadError(f"{self.path} is truncated at byte {self.size}: {what} needs bytes "
                                 f"{start}..{start + n}")
        self.pos = start + n
        return start

    def count(self, n: int, item_bytes: int, what: str) -> int:
        """A declared count, refused when its items could not fit in the bytes left."""
        if n * item_bytes > self.size - self.pos:
            raise ModelLoadError(f"{self.path} is truncated at byte {self.size}: {what} declares {n} items, which "
                                 f"need at least {n * item_bytes} bytes from byte {self.pos}")
        return n

    def u32(self, what: str) -> int:
        return int(_U32.unpack_from(self.buf, self.need(4, what))[0])

    def u64(self, what: str) -> int:
        return int(_U64.unpack_from(self.buf, self.need(8, what))[0])

    def string(self, what: str) -> str:
        n = self.u64(what)
        start = self.need(n, what)
        return self._decode(start, n, what)

    def _decode(self, start: int, n: int, what: str) -> str:
        try:
            return str(self.buf[start:start + n], "utf-8")
        except UnicodeDecodeError as e:
            raise ModelLoadError(f"{self.path}: {what} is not UTF-8 ({e.reason} at byte {start + e.start})") from None

    def strings(self, n: int, what: str) -> list[str]:
        """n strings in one loop: a tokenizer's vocabulary is tens of thousands of them."""
        buf, size, pos, unpack = self.buf, self.size, self.pos, _U64.unpack_from
        out: list[str] = []
        append = out.append
        for i in range(n):
            if size - pos < 8:
                self.pos = pos
                self.need(8, f"{what}[{i}]")
            length = unpack(buf, pos)[0]
            pos += 8
            end = pos + length
            if end > size:
                self.pos = pos
                self.need(length, f"{what}[{i}]")
            try:
                append(str(buf[pos:end], "utf-8"))
            except UnicodeDecodeError:
                self._decode(pos, length, f"{what}[{i}]")      # raises, naming the item
            pos = end
        self.pos = pos
        return out

    def value(self, kind: int, what: str, depth: int = 0) -> Any:
        if kind in SCALARS:
            fmt = SCALARS[kind]
            return struct.unpack_from(fmt, self.buf, self.need(struct.calcsize(fmt), what))[0]
        if kind == STRING:
            return self.string(what)
        if kind == ARRAY:
            if depth > 1:                           # GGUF allows nested arrays; no model nests them deeper
                raise ModelLoadError(f"{self.path}: {what} nests arrays more than two deep")
            item = self.u32(what)
            if item not in MIN_ITEM_BYTES:
                raise ModelLoadError(f"{self.path}: {what} is an array of unknown type {item}")
            n = self.count(self.u64(what), MIN_ITEM_BYTES[item], what)
            if item in SCALARS:
                dtype = np.dtype(SCALARS[item])
                return np.frombuffer(self.buf, dtype, n, self.need(n * dtype.itemsize, what))
            if item == STRING:
                return self.strings(n, what)
            return [self.value(item, f"{what}[{i}]", depth + 1) for i in range(n)]
        raise ModelLoadError(f"{self.path}: {what} has unknown value type {kind}")


def read_file(path: Path) -> GGUFContents:
    """The metadata and tensor table of a GGUF file; ModelLoadError naming what is wrong."""
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except ValueError:                        # an empty file
            raise ModelLoadError(f"{path} is empty, not a GGUF file") from None
    cur = _Cursor(path, buf)
    if buf[:4] != MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (no GGUF magic)")
    cur.pos = 4
    version = cur.u32("the version")
    if version not in VERSIONS:
        endian = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise ModelLoadError(f"{path}: GGUF version {version}{endian} is not supported (supported: 2, 3)")
    n_tensors = cur.u64("the tensor count")
    n_meta = cur.u64("the metadata count")
    cur.count(n_meta, 8 + 4 + 1, "the metadata table")         # key length, type, a one-byte value
    metadata: dict[str, Any] = {}
    for i in range(n_meta):
        key = cur.string(f"metadata key {i}")
        metadata[key] = cur.value(cur.u32(key), key)
    cur.count(n_tensors, 8 + 4 + 4 + 8, "the tensor table")     # name length, n_dims, type, offset
    table = [_tensor_entry(cur, i) for i in range(n_tensors)]
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ModelLoadError(f"{path}: general.alignment {alignment!r} is not a power of two")
    data_start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, kind, offset in table:
        if name in tensors:
            raise ModelLoadError(f"{path}: tensor {name} is listed twice")
        tensors[name] = _tensor(cur, name, dims, kind, data_start + offset)
    return GGUFContents(metadata, tensors, version)


def _tensor_entry(cur: _Cursor, i: int) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string(f"tensor {i}'s name")
    n_dims = cur.u32(f"tensor {name}'s dimension count")
    if not 1 <= n_dims <= MAX_DIMS:
        raise ModelLoadError(f"{cur.path}: tensor {name} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
    dims = tuple(cur.u64(f"tensor {name}'s shape") for _ in range(n_dims))
    return name, dims, cur.u32(f"tensor {name}'s type"), cur.u64(f"tensor {name}'s offset")


def _tensor(cur: _Cursor, name: str, dims: tuple[int, ...], kind: int, start: int) -> GGUFTensor:
    """The tensor's data as a view, after checking its type, its shape and that its bytes are there."""
    try:
        qtype = GGMLType(kind)
        block, type_size = QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise ModelLoadError(f"{cur.path}: tensor {name} has unknown type {kind}") from None
    if dims[0] % block:
        raise ModelLoadError(f"{cur.path}: tensor {name}'s rows of {dims[0]} are not whole {qtype.name} "
                             f"blocks of {block}")
    elements = 1
    for d in dims:
        elements *= d
    n_bytes = elements // block * type_size
    if n_bytes > cur.size - start:
        raise ModelLoadError(f"{cur.path} is truncated at byte {cur.size}: tensor {name} ({qtype.name}, "
                             f"shape {list(dims)}) needs bytes {start}..{start + n_bytes}")
    shape = tuple(reversed(dims))                 # numpy's order: the slowest dimension first
    dtype = ELEMENT_DTYPES.get(qtype.name)
    if dtype is not None:
        data = np.frombuffer(cur.buf, dtype, elements, start).reshape(shape)
    else:                                         # whole blocks as bytes, one row per row
        data = np.frombuffer(cur.buf, np.uint8, n_bytes, start).reshape(*shape[:-1], shape[-1] // block * type_size)
    return GGUFTensor(name, qtype, dims, data, start, n_bytes)
