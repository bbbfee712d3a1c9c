"""What loading the real model costs (issue 36, item 5): the GGUF's tensors are read as views of a
private map and copied once, into what the model keeps, after which the file is no longer mapped;
the tokenizer is built from the metadata in a few calls into `tokenizers`; the load's copies run on
one torch thread; the KV cache is resident only where it was written."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import pagedecode as pd
from pagedecode.model import loader
from pagedecode.model.gguf_file import read_metadata
from pagedecode.model.gguf_tokenizer import build_tokenizer
from pagedecode.model.kv_cache import KVCache

CHILD = """
import gc, json, sys
import pagedecode as pd

def status():
    return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in open("/proc/self/status"))
            if k in ("VmRSS", "RssAnon", "RssFile")}
engine = pd.Engine.from_pretrained(sys.argv[1])
out = engine.generate(["What is the capital of France?"], pd.SamplingParams(max_tokens=4, ignore_eos=True))[0]
gc.collect()
print(json.dumps({"mapped": sys.argv[1] in open("/proc/self/maps").read(), "weight_bytes": engine.weight_bytes,
                  "kv_bytes": engine.kv.num_pages * engine.config.page_size * engine.bytes_per_token,
                  "tokens": len(out.token_ids), **status()}))
"""


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.fixture(scope="module")
def loaded(smollm2_path):
    """A fresh process (no TRITON_INTERPRET, as a user runs it) after one request on the Q4_1 file."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", CHILD, str(smollm2_path)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


def test_the_file_is_not_mapped_once_loaded(loaded):
    """Every weight was copied out of the map (q / k un-permuted, q, k, v and gate, up stacked, the
    rest owned): no view keeps the file's pages resident beside the copies."""
    assert not loaded["mapped"] and loaded["tokens"] == 4


def test_resident_memory_after_a_request_is_torch_weights_and_used_kv(loaded):
    """One copy of the weights (their file's size), the KV cache resident only where written:
    well under the 600 MB that serve must stay within, torch (~220 MB) included."""
    assert loaded["RssAnon"] < loaded["weight_bytes"] + 250e6, loaded        # torch's own heap is ~145 MB
    assert loaded["VmRSS"] < 450e6, loaded
    assert loaded["VmRSS"] < 220e6 + loaded["weight_bytes"] + loaded["kv_bytes"], loaded


def test_the_tokenizer_is_built_from_metadata_in_well_under_a_second(smollm2_path):
    """SmolLM2's 49,152 tokens and 48,900 merges: ~0.1 s of CPU (a per-token Python parse took ~4 s).
    Counted in CPU time, so a busy machine does not fail it."""
    meta = read_metadata(smollm2_path)
    start = time.process_time()
    tok = build_tokenizer(meta)
    took = time.process_time() - start
    assert tok.encode("Hello world", add_special_tokens=False) == [19556, 905]
    assert took < 1.0, took
    # given from the token list, as the vocabulary would give it on the first request
    assert tok.max_token_bytes == max(len(s.encode()) for s in tok._tok.get_vocab(with_added_tokens=True)) == 162


def test_the_load_runs_on_one_torch_thread(stories_path, monkeypatch):
    seen = []
    build = loader.LlamaModel

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return build(*args, **kwargs)
    monkeypatch.setattr(loader, "LlamaModel", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        loader.load_model(stories_path)
        assert seen == [1] and torch.get_num_threads() == 2
        with pytest.raises(RuntimeError, match="boom"), loader.one_torch_thread():
            raise RuntimeError("boom")
        assert torch.get_num_threads() == 2                      # put back on an error too
    finally:
        torch.set_num_threads(before)


def test_the_kv_cache_is_resident_only_where_written():
    """256 MiB of cache: zeros everywhere, resident as pages are first written."""
    before = rss()
    kv = KVCache(num_layers=4, num_pages=2048, page_size=16, num_kv_heads=4, head_dim=64, dtype=torch.float32)
    assert kv.k.numel() * 4 == 128 << 20
    assert rss() - before < 16 << 20
    assert not kv.k[3, 2047].any() and not kv.v[0, 0].any()
    kv.k[:, :64] = 1.0                                          # 64 pages of each layer: 4 MiB
    assert 4 << 20 <= rss() - before < 24 << 20
    assert kv.k[:, :64].eq(1).all() and not kv.k[:, 64:].any()
    assert pd.KVCache is KVCache
