import json
import shutil

import pytest
import torch

import pagedecode as pd

transformers = pytest.importorskip("transformers")


@pytest.fixture
def model_dir(tmp_path, stories_path):
    d = tmp_path / "m"
    shutil.copytree(stories_path, d, ignore=shutil.ignore_patterns("source"))
    return d


def test_missing_directory_and_files_are_named(tmp_path, model_dir):
    with pytest.raises(pd.ModelLoadError, match="not found"):
        pd.load_model(tmp_path / "nope")
    (model_dir / "tokenizer.json").unlink()
    with pytest.raises(pd.ModelLoadError, match="tokenizer.json"):
        pd.load_model(model_dir)


def test_missing_weights_and_config(tmp_path, model_dir):
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(pd.ModelLoadError, match="safetensors"):
        pd.load_model(model_dir)
    (model_dir / "config.json").unlink()
    with pytest.raises(pd.ModelLoadError, match="config.json"):
        pd.load_model(model_dir)


def test_unsupported_architecture_is_named(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(pd.ModelLoadError, match="gpt2.*GPT2LMHeadModel"):
        pd.load_model(model_dir)


def test_missing_tensor_is_named(model_dir):
    from safetensors.torch import load_file, save_file
    w = load_file(str(model_dir / "model.safetensors"))
    del w["model.layers.3.mlp.up_proj.weight"]
    save_file(w, str(model_dir / "model.safetensors"))
    with pytest.raises(pd.ModelLoadError, match="layers.3.mlp.up_proj"):
        pd.load_model(model_dir)


def test_sharded_checkpoint_and_every_eos_id(tmp_path, stories_path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(stories_path)
    d = tmp_path / "sharded"
    hf.save_pretrained(d, max_shard_size="200KB", safe_serialization=True)
    assert (d / "model.safetensors.index.json").is_file() and len(list(d.glob("*.safetensors"))) > 1
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(stories_path / f, d / f)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 426], "bos_token_id": 1}))
    engine = pd.Engine.from_pretrained(d)
    assert {2, 426} <= engine.eos_ids
    # 426 is "." in stories260k: generation now ends at the first full stop, as EOS
    out = engine.generate("Once upon a time", pd.SamplingParams(max_tokens=32))[0]
    assert out.finish_reason == pd.FinishReason.EOS
    assert out.text == ", there was a little girl named Lily"
    assert out.selected_token_ids[-1] == 426 and 426 not in out.token_ids


def test_bytes_per_token_and_capacity(stories_path):
    engine = pd.Engine.from_pretrained(stories_path, max_cache_tokens=1000, page_size=16)
    assert engine.bytes_per_token == 2 * 5 * 4 * 8 * 4
    assert engine.pool.num_pages == 1000 // 16
    engine = pd.Engine.from_pretrained(stories_path, memory_budget_bytes=1280 * 64 * 3 + 5)
    assert engine.pool.num_pages == 12
    assert engine.max_context == 192
    with pytest.raises(pd.InvalidRequestError, match="context limit of 192"):
        engine.add_request(list(range(3, 196)))
    assert engine.kv.k.dtype == torch.float32
