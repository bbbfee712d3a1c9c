"""The start-up line states what the engine holds: weights by their real format (a q8_0 model is
not "float32 weights"), adding up to weight_bytes; the KV cache's dtype, tokens and bytes; the
threads. Progress bars only on a terminal."""
import io
import re

import pytest

import pagedecode as pd
from pagedecode.progress import progress
from pagedecode.runtime.footprint import describe


def test_a_quantized_model_says_q8_0(stories_path):
    engine = pd.Engine.from_pretrained(stories_path, quantization="q8_0", kv_cache_dtype="float16", num_threads=1,
                                       max_cache_tokens=1024)
    line = describe(engine)
    formats = engine.model.weight_formats()
    assert "q8_0" in formats and "float32" in formats and sum(formats.values()) == engine.weight_bytes
    assert line.startswith(f"weights {engine.weight_bytes / 1e6:.1f} MB (") and "q8_0 " in line
    assert re.search(r"KV cache of 1024 tokens in float16 \([\d.]+ MB\), 1 threads$", line), line
    assert f"({1024 * engine.bytes_per_token_total / 1e6:.1f} MB)" in line


def test_float_weights_and_their_packed_copies(stories_path):
    plain = pd.Engine.from_pretrained(stories_path)
    packed = pd.Engine.from_pretrained(stories_path, cpu_pack_weights=True)
    assert set(plain.model.weight_formats()) <= {"float32", "copies"}
    assert sum(packed.model.weight_formats().values()) == packed.weight_bytes
    if packed.weight_bytes > plain.weight_bytes:          # oneDNN present: the second copy is named
        assert packed.model.weight_formats()["copies"] > plain.model.weight_formats().get("copies", 0)


def test_progress_only_on_a_terminal(monkeypatch):
    items = [1, 2, 3]
    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert progress(items, "loading layers") is items
    tty = io.StringIO()
    tty.isatty = lambda: True
    monkeypatch.setattr("sys.stderr", tty)
    pytest.importorskip("tqdm")
    bar = progress(items, "loading layers")
    assert bar is not items and list(bar) == items
