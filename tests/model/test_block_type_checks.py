"""Every block type through the load-time checks (issue 35.8, the checks of issue 34): a GGUF file
whose weights are in that type is refused, naming the tensor, when one of them is cut short or has
a shape its configuration does not give it -- from the file's tensor table, before any tensor's
data is read (gguf_file.read_tensor, where weights are copied, is made to fail the test)."""
from __future__ import annotations

import pytest

import pagedecode as pd
from pagedecode.errors import ModelLoadError
from pagedecode.model import gguf_file

from .gguf_files import Q, bytelevel_tokenizer_meta, gguf, random_llama, write_gguf

BLOCK_QTYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer Llama (hidden 256: whole K-quant super-blocks) and the default model's tokenizer."""
    from pagedecode.model.default_model import BOS, EOS, default_model_path
    cfg, weights = random_llama(seed=11)
    meta = bytelevel_tokenizer_meta(default_model_path() / "tokenizer.json", BOS, EOS)
    return tmp_path_factory.mktemp("block_checks"), cfg, weights, meta


@pytest.fixture
def no_reads(monkeypatch):
    def refuse(t):
        raise AssertionError(f"{t.name}'s data was read before the file was refused")
    monkeypatch.setattr(gguf_file, "read_tensor", refuse)


@pytest.mark.parametrize("qtype", BLOCK_QTYPES, ids=lambda q: q.name)
def test_a_tensor_cut_short_is_refused_before_any_read(tiny, qtype, no_reads):
    folder, cfg, weights, meta = tiny
    path = folder / f"whole-{qtype.name}.gguf"
    write_gguf(path, cfg, weights, meta, qtype=qtype)
    last = max(gguf.GGUFReader(str(path)).tensors, key=lambda t: t.data_offset)
    assert last.tensor_type == qtype                       # the cut falls in a tensor of this type
    cut = folder / f"cut-{qtype.name}.gguf"
    cut.write_bytes(path.read_bytes()[:last.data_offset + last.n_bytes - 1])
    with pytest.raises(ModelLoadError, match=rf"truncated at byte .*tensor {last.name} \({qtype.name}, "):
        pd.load_model(cut)


@pytest.mark.parametrize("qtype", BLOCK_QTYPES, ids=lambda q: q.name)
def test_a_tensor_of_the_wrong_shape_is_refused_before_any_read(tiny, qtype, no_reads):
    folder, cfg, weights, meta = tiny
    short = dict(weights)
    short["model.layers.1.mlp.up_proj.weight"] = weights["model.layers.1.mlp.up_proj.weight"][:256]
    path = folder / f"shape-{qtype.name}.gguf"
    write_gguf(path, cfg, short, meta, qtype=qtype)
    assert next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.1.ffn_up.weight").tensor_type == qtype
    with pytest.raises(ModelLoadError, match=r"layers\.1\.mlp\.up_proj\.weight has shape \[256, 256\].*needs \[512, 256\]"):
        pd.load_model(path)
