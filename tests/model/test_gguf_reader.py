"""model/gguf_reader.py reads what gguf's own GGUFReader reads: every value type, arrays, nested
arrays and the tensors' data, as the loader used to receive them."""
from __future__ import annotations

import numpy as np
import pytest

from pagedecode.errors import ModelLoadError
from pagedecode.model.gguf_reader import read_file

from .gguf_files import Q, gguf

V = gguf.GGUFValueType
VALUES = {
    "t.u8": (200, V.UINT8), "t.i8": (-100, V.INT8), "t.u16": (60000, V.UINT16), "t.i16": (-30000, V.INT16),
    "t.u32": (4_000_000_000, V.UINT32), "t.i32": (-2_000_000_000, V.INT32), "t.f32": (0.1, V.FLOAT32),
    "t.bool": (True, V.BOOL), "t.str": ("naïve ▁ 日本語", V.STRING), "t.u64": (2 ** 63, V.UINT64),
    "t.i64": (-(2 ** 62), V.INT64), "t.f64": (1e-300, V.FLOAT64), "t.empty": ("", V.STRING),
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    path = tmp_path_factory.mktemp("reader") / "values.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, (value, vtype) in VALUES.items():
        w.add_key_value(key, value, vtype)
    w.add_array("t.ints", [3, -1, 7])
    w.add_array("t.floats", [0.5, -2.25])
    w.add_array("t.strings", ["a", "", "ünï", "x" * 1000])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_array("t.empty_array", [])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4,)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), Q.Q8_0)
    w.add_tensor("q8", q8, raw_shape=q8.shape, raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def plain(value):
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value.tolist() if isinstance(value, np.ndarray) else value


def test_metadata_as_gguf_reads_it(written):
    ours = read_file(written)
    theirs = gguf.GGUFReader(str(written))
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    got = {k: plain(v) for k, v in ours.metadata.items()}
    assert got.pop("t.nested") == [[1, 2], [3]]          # GGUFReader flattens nested arrays: [1, 2, 3]
    del expected["t.nested"]
    assert got == expected
    assert ours.metadata["t.str"] == "naïve ▁ 日本語" and ours.metadata["t.u64"] == 2 ** 63


def test_tensors_as_gguf_reads_them(written):
    ours = read_file(written).tensors
    theirs = {t.name: t for t in gguf.GGUFReader(str(written)).tensors}
    assert list(ours) == list(theirs)
    for name, t in ours.items():
        assert t.tensor_type == theirs[name].tensor_type and t.shape == tuple(theirs[name].shape.tolist())
        assert t.data.dtype == theirs[name].data.dtype and np.array_equal(t.data, theirs[name].data), name


def test_the_type_table_is_ggufs():
    """The reader names types without importing `gguf` (whose import builds every enum of its
    constants): the same numbers, names and block sizes."""
    from pagedecode.model.gguf_reader import QUANT_SIZES, GGMLType
    theirs = {int(q): (q.name, gguf.GGML_QUANT_SIZES[q]) for q in gguf.GGMLQuantizationType}
    ours = {int(q): (q.name, QUANT_SIZES[q]) for q in GGMLType}
    # gguf-py before 0.19 gave Q8_1 40 bytes; ggml's block_q8_1 is two halves and 32 int8 (36).
    # An older gguf also lacks the newest types: compare the ones both know.
    assert ours.pop(GGMLType.Q8_1) == ("Q8_1", (32, 2 + 2 + 32))
    common = set(theirs) & set(ours)
    assert {k: theirs[k] for k in common} == {k: ours[k] for k in common}
    assert len(common) >= 25
    assert set(ours) >= {0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30}       # every type pagedecode loads
    assert GGMLType.Q4_1 == gguf.GGMLQuantizationType.Q4_1


def test_tensor_data_are_writable_views_of_a_private_map(written):
    """torch takes the views as they are (no copy, no read-only warning); a write stays in this
    process's copy of the page, never in the file."""
    before = written.read_bytes()
    t = next(iter(read_file(written).tensors.values()))
    assert t.data.flags.writeable and not t.data.flags.owndata
    t.data.reshape(-1).view(np.uint8)[:4] = 0xAB
    assert written.read_bytes() == before


def test_not_utf8_names_the_key(written, tmp_path):
    data = bytearray(written.read_bytes())
    at = data.index("naïve".encode())
    data[at] = 0xFF
    bad = tmp_path / "latin.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="t.str is not UTF-8"):
        read_file(bad)


def test_not_gguf_and_big_endian(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGML" + bytes(20))
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        read_file(bad)
    bad.write_bytes(b"GGUF" + (3).to_bytes(4, "big") + bytes(16))
    with pytest.raises(ModelLoadError, match="big-endian"):
        read_file(bad)
