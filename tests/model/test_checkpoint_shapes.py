"""A checkpoint whose metadata disagrees with its tensors is refused at load, naming the tensor,
the shape its configuration needs and the shape found (issue 34.1: these reached the compiled
CPU forward, which wrote out of bounds); absurd sizes and token ids are one line each."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import pagedecode as pd
from pagedecode import cli
from pagedecode.errors import ModelLoadError
from pagedecode.model.config import ModelConfig
from pagedecode.model.shapes import check_shape

from .gguf_files import bytelevel_tokenizer_meta, gguf, random_llama, write_gguf

U32, U64 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.UINT64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer Llama (4 heads of 64, 2 KV heads) and the default model's tokenizer."""
    from pagedecode.model.default_model import BOS, EOS, default_model_path
    cfg, weights = random_llama(seed=5)
    meta = bytelevel_tokenizer_meta(default_model_path() / "tokenizer.json", BOS, EOS)
    return tmp_path_factory.mktemp("shapes"), cfg, weights, meta


@pytest.fixture
def default_dir(tmp_path):
    """The built-in default model (4 heads of 32, 2 KV heads), copied to edit its config.json."""
    from pagedecode.model.default_model import default_model_path
    d = tmp_path / "default"
    shutil.copytree(default_model_path(), d)
    return d


def edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def test_check_shape_names_the_tensor_and_both_shapes():
    check_shape("model.norm.weight", (64,), torch.Size([64]))
    with pytest.raises(ModelLoadError, match=r"tensor x\.weight has shape \[3, 4\], but .* needs \[4, 4\]"):
        check_shape("x.weight", (4, 4), (3, 4))


def test_gguf_head_count_kv_zero_is_refused(tiny):
    """It fell back to 4 KV heads while the tensors hold 2."""
    folder, cfg, weights, meta = tiny
    path = folder / "kv0.gguf"
    write_gguf(path, cfg, weights, meta, overrides={"llama.attention.head_count_kv": (0, U32)})
    with pytest.raises(ModelLoadError, match=r"num_kv_heads .*head_count_kv\) is 0"):
        pd.load_model(path)


def test_gguf_kv_heads_disagreeing_with_k_proj(tiny):
    folder, cfg, weights, meta = tiny
    path = folder / "kv4.gguf"
    write_gguf(path, cfg, weights, meta, overrides={"llama.attention.head_count_kv": (4, U32)})
    with pytest.raises(ModelLoadError, match=r"layers\.0\.self_attn\.k_proj\.weight has shape \[128, 256\].*"
                                             r"needs \[256, 256\]"):
        pd.load_model(path)


def test_gguf_q_proj_with_half_its_rows(tiny):
    folder, cfg, weights, meta = tiny
    path = folder / "q128.gguf"
    cut = dict(weights)
    cut["model.layers.1.self_attn.q_proj.weight"] = weights["model.layers.1.self_attn.q_proj.weight"][:128]
    write_gguf(path, cfg, cut, meta)
    with pytest.raises(ModelLoadError, match=r"layers\.1\.self_attn\.q_proj\.weight has shape \[128, 256\].*"
                                             r"needs \[256, 256\]"):
        pd.load_model(path)


def test_config_json_kv_heads_disagreeing_with_the_tensors(default_dir):
    edit_config(default_dir, num_key_value_heads=4)
    with pytest.raises(ModelLoadError, match=r"k_proj\.weight has shape \[64, 128\].*needs \[128, 128\]"):
        pd.load_model(default_dir)


def test_tensor_parallel_shard_checks_the_full_shapes_first(default_dir):
    """Each rank's loader (model/shard.load_shard) slices the tensors by the configuration: a
    k_proj of 2 KV heads under a config of 4 sliced into a rank's "half" without complaint."""
    from pagedecode.model.loader import load_config
    from pagedecode.model.shard import load_shard
    edit_config(default_dir, num_key_value_heads=4)
    with pytest.raises(ModelLoadError, match=r"k_proj\.weight has shape \[64, 128\].*needs \[128, 128\]"):
        load_shard(default_dir, load_config(default_dir), rank=0, n=2)


def test_config_json_head_dim_disagreeing_with_the_tensors(default_dir):
    edit_config(default_dir, head_dim=64)
    with pytest.raises(ModelLoadError, match=r"q_proj\.weight has shape \[128, 128\].*needs \[256, 128\]"):
        pd.load_model(default_dir)


@pytest.mark.parametrize("key, value, message", [
    ("llama.attention.head_count", (0, U32), r"num_heads .*head_count\) is 0"),
    ("llama.context_length", (2 ** 40, U64), r"max_position_embeddings .*context_length\) is 1099511627776"),
    ("llama.embedding_length", (2 ** 40, U64), r"hidden_size .*embedding_length\) is 1099511627776"),
    ("llama.embedding_length", (512, U32), r"embed_tokens\.weight has shape \[512, 256\].*needs \[512, 512\]"),
    ("tokenizer.ggml.bos_token_id", (10 ** 6, U32), r"bos_token_id 1000000 is outside its vocabulary of 512"),
    ("tokenizer.ggml.eos_token_id", (512, U32), r"eos_token_id 512 is outside its vocabulary of 512"),
], ids=["head_count_0", "context_2^40", "embedding_2^40", "embedding_512", "bos_10^6", "eos_512"])
def test_gguf_absurd_sizes_and_token_ids_are_one_line(tiny, capsys, key, value, message):
    folder, cfg, weights, meta = tiny
    path = folder / f"bad-{key}-{value[0]}.gguf"
    write_gguf(path, cfg, weights, meta, overrides={key: value})
    with pytest.raises(ModelLoadError, match=message):
        pd.load_model(path)
    assert cli.main(["generate", "--model", str(path), "--prompt", "hi", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedecode: ") and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("changes, message", [
    ({"num_attention_heads": 0}, r"num_heads .*num_attention_heads.* is 0"),
    ({"num_key_value_heads": 0}, r"num_kv_heads .*num_key_value_heads.* is 0"),
    ({"max_position_embeddings": -1}, r"max_position_embeddings .* is -1"),
    ({"hidden_size": "128"}, r"hidden_size .* is '128'"),
    ({"eos_token_id": 9999}, r"eos_token_id 9999 is outside its vocabulary of 512"),
    ({"num_hidden_layers": 4000}, r"the configuration has 4000 layers, but the checkpoint holds 4 \(none for layer 4\)"),
])
def test_config_json_absurd_values_are_one_line(default_dir, changes, message):
    edit_config(default_dir, **changes)
    with pytest.raises(ModelLoadError, match=message):
        pd.load_model(default_dir)


def test_generation_config_eos_outside_the_vocabulary(default_dir):
    (default_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 70000]}))
    with pytest.raises(ModelLoadError, match="eos_token_id 70000 is outside"):
        pd.load_model(default_dir)


def test_model_config_refuses_zero_kv_heads_directly():
    """Not a ZeroDivisionError from the head-group check."""
    with pytest.raises(ModelLoadError, match="num_kv_heads"):
        ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=0,
                    head_dim=4, max_position_embeddings=16)
