"""GGUF files that made the loader run away (issue 34.2) or fail with numpy's words (34.10):
each fails, or loads, within 2 s at under twice the file's size in memory, measured in a
subprocess (its peak RSS, reset before loading, over its resident size then); a truncated file names the byte it
ends at."""
from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pagedecode as pd
from pagedecode.errors import ModelLoadError
from pagedecode.model.batch import ForwardBatch
from pagedecode.model.gguf_tokenizer import spm_merges

from .gguf_files import bytelevel_tokenizer_meta, gguf, random_llama, write_gguf

U32, U64 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.UINT64
SECONDS = 2.0

CHILD = """
import json, sys, time
import gguf, numpy, tokenizers, torch
import pagedecode as pd
from pagedecode.model.loader import load_model
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))
with open("/proc/self/clear_refs", "w") as f:     # the peak (VmHWM) back to what is resident now
    f.write("5")
before = status("VmRSS")
start = time.perf_counter()
try:
    model, tok = load_model(sys.argv[1])
    outcome = "loaded"
except pd.ModelLoadError as e:
    outcome = "refused: " + str(e)
seconds = time.perf_counter() - start
grown = (status("VmHWM") - before) * 1024
print(json.dumps({"outcome": outcome, "seconds": seconds, "grown": grown}))
"""


def load_in_child(path: Path) -> dict:
    """load_model(path) in a fresh interpreter (capped at 4 GB, killed after 60 s): its outcome,
    seconds and peak RSS growth in bytes (Linux: /proc/self/clear_refs resets the peak)."""
    cap = "import resource; resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))\n"
    done = subprocess.run([sys.executable, "-c", CHILD.replace("import json,", cap + "import json,", 1), str(path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def assert_bounded(path: Path, outcome: str, plain_growth: int = 0) -> dict:
    """Refused: within 2 s, its peak RSS grown by under twice the file's size. Loaded: within 2 s,
    grown by under the file's size more than the same kind of model from a plain file
    (`plain_growth`: float weights, their packed copies, the tokenizer, the thread pools)."""
    r = load_in_child(path)
    assert r["outcome"].startswith(outcome), r["outcome"]
    assert r["seconds"] < SECONDS, r
    size = path.stat().st_size
    assert r["grown"] < (2 * size if outcome == "refused" else plain_growth + size), r
    return r


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from pagedecode.model.default_model import BOS, EOS, default_model_path
    cfg, weights = random_llama(seed=9)
    meta = bytelevel_tokenizer_meta(default_model_path() / "tokenizer.json", BOS, EOS)
    folder = tmp_path_factory.mktemp("bounds")
    path = folder / "tiny.gguf"
    write_gguf(path, cfg, weights, meta)
    return folder, cfg, weights, meta, path


@pytest.fixture(scope="module")
def plain_growth(tiny) -> int:
    """What loading the plain tiny file grows the peak RSS by."""
    r = load_in_child(tiny[-1])
    assert r["outcome"] == "loaded"
    return int(r["grown"])


def value_offset(data: bytes, key: str) -> int:
    """Where the value of metadata `key` starts (after its key string and type)."""
    name = key.encode()
    at = data.index(struct.pack("<Q", len(name)) + name)
    return at + 8 + len(name) + 4


def test_array_count_of_2_40_is_refused_at_once(tiny):
    """tokenizer.ggml.token_type claiming 2^40 items grew the reader ~100 MB/s without end."""
    folder, *_, path = tiny
    data = bytearray(path.read_bytes())
    at = value_offset(bytes(data), "tokenizer.ggml.token_type")      # item type u32, then the count
    data[at + 4:at + 12] = struct.pack("<Q", 2 ** 40)
    bad = folder / "count.gguf"
    bad.write_bytes(bytes(data))
    r = assert_bounded(bad, "refused")
    assert "tokenizer.ggml.token_type declares 1099511627776 items" in r["outcome"]


def test_block_count_of_2_31_is_refused_at_once(tiny):
    """It looped over 2^31 layers the file does not hold."""
    folder, cfg, weights, meta, _ = tiny
    bad = folder / "blocks.gguf"
    write_gguf(bad, cfg, weights, meta, overrides={"llama.block_count": (2 ** 31, U32)})
    assert "num_layers" in assert_bounded(bad, "refused")["outcome"]
    more = folder / "blocks4000.gguf"                      # within the sane range, more than it holds
    write_gguf(more, cfg, weights, meta, overrides={"llama.block_count": (4000, U32)})
    assert "4000 layers, but the checkpoint holds 2" in assert_bounded(more, "refused")["outcome"]


def test_context_length_of_2_24_loads_small(tiny, plain_growth):
    """The RoPE table was sized by the declared context: > 6.5 GB for 2^24 positions."""
    folder, cfg, weights, meta, _ = tiny
    big = folder / "context.gguf"
    write_gguf(big, cfg, weights, meta, overrides={"llama.context_length": (2 ** 24, U32)})
    assert_bounded(big, "loaded", plain_growth)


def far_batch(first: int, n: int, page: int) -> ForwardBatch:
    """n tokens at positions first.. of one sequence whose earlier cache (zeros) fills its pages."""
    seq = first + n
    pages = list(range(-(-seq // page)))
    positions = torch.arange(first, seq)
    return ForwardBatch(torch.arange(5, 5 + n), positions, positions.clone(), torch.tensor([pages], dtype=torch.int32),
                        torch.tensor([seq], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32),
                        torch.arange(n), num_decode=0, max_new=n)


def test_rope_tables_grow_to_the_positions_used(tiny, monkeypatch):
    """A model declaring 2^24 positions starts with ROPE_FIRST_POSITIONS rows; a batch past them
    grows the tables, and both forwards (compiled and torch) compute as a model built with the
    whole table from the start."""
    from pagedecode.model import llama
    folder, cfg, weights, meta, _ = tiny
    big = folder / "context-forward.gguf"
    write_gguf(big, cfg, weights, meta, overrides={"llama.context_length": (2 ** 24, U32)})
    first = llama.ROPE_FIRST_POSITIONS
    grown, _ = pd.load_model(big)
    grown_torch, _ = pd.load_model(big, attention_backend="torch")
    assert grown.cos.shape[0] == first
    monkeypatch.setattr(llama, "ROPE_FIRST_POSITIONS", 4 * first)
    whole, _ = pd.load_model(big, attention_backend="torch")
    batch, page = far_batch(first + 100, 3, 16), 16
    c = whole.config

    def logits(model: llama.LlamaModel) -> torch.Tensor:
        kv = pd.KVCache(c.num_layers, batch.page_table.shape[1], page, c.num_kv_heads, c.head_dim, model.dtype)
        return model.forward(batch, kv)

    expected = logits(whole)
    torch.testing.assert_close(logits(grown_torch), expected, atol=0, rtol=0)
    torch.testing.assert_close(logits(grown), expected, atol=1e-4, rtol=1e-4)
    assert grown.cos.shape[0] == 2 * first and grown.cos.equal(whole.cos[:2 * first])


def spm_meta(pieces: list[str]) -> dict:
    """A SentencePiece ("llama") tokenizer: unknown, BOS, EOS, the 256 byte pieces, then `pieces`."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return {"tokenizer_model": "llama", "token_list": tokens, "token_types": types, "token_scores": scores,
            "bos_token_id": 1, "eos_token_id": 2, "unk_token_id": 0}


def test_a_640_kb_sentencepiece_piece_loads_fast(tiny, plain_growth):
    """Merges were derived from every cut of every piece: 62 s for one 640 KB piece."""
    folder, *_ = tiny
    pieces = ["▁", "a", "b", "ab", "▁ab", "▁a", "abab", "▁" + "ab" * 320_000]
    meta = spm_meta(pieces)
    cfg, weights = random_llama(seed=9, vocab=len(meta["token_list"]))
    path = folder / "piece.gguf"
    write_gguf(path, cfg, weights, meta)
    assert_bounded(path, "loaded", plain_growth)
    _, tok = pd.load_model(path)
    assert tok.decode(tok.encode("ab abab")) == "ab abab"


def test_spm_merges_try_only_cuts_of_known_lengths():
    """The same merges as every cut gives, best score first, ties by id."""
    tokens = ["<unk>", "a", "b", "c", "ab", "bc", "abc", "abcab", "ca", "x" * 50]
    types = [2] + [1] * 9
    scores = [0.0, -1, -1, -1, -2, -3, -4, -5, -6, -7]
    every = sorted((-scores[i], i, tokens.index(p[:k]), p[:k], p[k:]) for i, p in enumerate(tokens)
                   if types[i] == 1 for k in range(1, len(p)) if p[:k] in tokens and p[k:] in tokens)
    assert spm_merges(tokens, scores, types) == [(left, right) for *_, left, right in every]
    assert spm_merges(tokens, scores, types)[:3] == [("a", "b"), ("b", "c"), ("a", "bc")]


@pytest.mark.parametrize("where", ["header", "metadata", "tokens", "tensor table", "tensor data"])
def test_truncated_file_names_the_byte_it_ends_at(tiny, where):
    folder, *_, path = tiny
    data = path.read_bytes()
    cut = {"header": 13,
           "metadata": value_offset(data, "llama.block_count") + 2,
           "tokens": value_offset(data, "tokenizer.ggml.tokens") + 2000,
           "tensor table": data.index(b"blk.1.attn_q.weight") + 5,
           "tensor data": len(data) - 1000}[where]
    bad = folder / f"cut-{cut}.gguf"
    bad.write_bytes(data[:cut])
    with pytest.raises(ModelLoadError, match=f"is truncated at byte {cut}: "):
        pd.load_model(bad)
