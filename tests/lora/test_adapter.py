"""Reading a PEFT adapter and checking it against the model: every bad file is one AdapterError
naming the adapter and the problem, and the engine serves on."""
import json

import pytest
import torch

import pagedecode as pd
from pagedecode.lora.adapter import load_adapter
from pagedecode.model.loader import load_config

from .helpers import SEVEN, write_adapter


@pytest.fixture(scope="module")
def config(stories_path):
    return json.loads((stories_path / "config.json").read_text())


@pytest.fixture(scope="module")
def model_config(stories_path):
    return load_config(stories_path)


def test_scaling_rank_and_projections_from_the_files(tmp_path, config, model_config):
    a = load_adapter("a", write_adapter(tmp_path / "a", config, r=4, alpha=8.0, targets=["q_proj", "down_proj"]),
                     model_config, 64)
    assert a.rank == 4 and a.projections == {"q_proj", "down_proj"}
    assert {w.scaling for w in a.weights.values()} == {2.0}
    assert len(a.weights) == 2 * config["num_hidden_layers"]
    rs = load_adapter("rs", write_adapter(tmp_path / "rs", config, r=16, alpha=8.0, config_extra={"use_rslora": True}),
                      model_config, 64)
    assert {w.scaling for w in rs.weights.values()} == {8.0 / 4.0}          # alpha / sqrt(r)


def test_the_digest_follows_the_weights(tmp_path, config, model_config):
    one = load_adapter("x", write_adapter(tmp_path / "one", config), model_config, 64)
    again = load_adapter("x", write_adapter(tmp_path / "one", config), model_config, 64)
    other = load_adapter("x", write_adapter(tmp_path / "other", config), model_config, 64)
    assert one.digest == again.digest and one.digest != other.digest and one.key != other.key


BAD = {
    "rank above the limit": (dict(r=32), "rank 32 is above max_lora_rank 16"),
    "wrong shape": (dict(extra_tensors={
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 65)}), "do not fit the model"),
    "module the model lacks": (dict(extra_tensors={
        "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}), "lm_head.lora_A.weight is not the LoRA A"),
    "targets a module the layers lack": (dict(targets=["q_proj", "c_attn"]), "c_attn"),
    "layer past the last": (dict(layers=[0, 7]), "the model has 5 layers"),
    "B missing": (dict(drop=["base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"]),
                  "layer 1 up_proj: lora_B is missing"),
    "DoRA": (dict(config_extra={"use_dora": True}), "DoRA"),
    "trained biases": (dict(config_extra={"bias": "lora_only"}), "bias='lora_only'"),
    "per-module alphas": (dict(config_extra={"alpha_pattern": {"q_proj": 4}}), "alpha_pattern"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_adapter_is_refused_by_name(tmp_path, config, model_config, case):
    options, message = BAD[case]
    targets = options.pop("targets", SEVEN)
    if "c_attn" in targets:        # the file holds q_proj only; the config names c_attn too
        folder = write_adapter(tmp_path / "bad", config, targets=["q_proj"], **options)
        cfg = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": targets}))
    else:
        folder = write_adapter(tmp_path / "bad", config, targets=targets, **options)
    with pytest.raises(pd.AdapterError) as e:
        load_adapter("my-adapter", folder, model_config, 16)
    assert "'my-adapter'" in str(e.value) and message in str(e.value)


def test_missing_and_unreadable_files_are_refused_by_name(tmp_path, config, model_config):
    with pytest.raises(pd.AdapterError, match="'gone'.*is not a folder"):
        load_adapter("gone", tmp_path / "nowhere", model_config, 64)
    folder = write_adapter(tmp_path / "broken", config)
    (folder / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(pd.AdapterError, match="'broken': cannot read"):
        load_adapter("broken", folder, model_config, 64)
    (folder / "adapter_config.json").write_text("{")
    with pytest.raises(pd.AdapterError, match="'broken': cannot read .*adapter_config.json"):
        load_adapter("broken", folder, model_config, 64)


def test_the_engine_serves_on_after_a_bad_adapter(tmp_path, config, stories_path):
    engine = pd.Engine.from_pretrained(stories_path, max_lora_rank=8)
    bad = write_adapter(tmp_path / "big", config, r=16)
    params = pd.SamplingParams(max_tokens=4)
    with pytest.raises(pd.AdapterError, match="'big'.*rank 16 is above max_lora_rank 8"):
        engine.generate("Once upon", params, lora=pd.LoRARequest("big", bad))
    assert not engine.has_unfinished()
    good = write_adapter(tmp_path / "good", config, r=8)
    outs = engine.generate(["Once upon", "Once upon"], params, lora=[pd.LoRARequest("good", good), None])
    assert all(o.finish_reason is not None and len(o.selected_token_ids) == 4 for o in outs)
    with pytest.raises(pd.AdapterError, match="'good' is loaded from"):
        engine.add_request("Once", params, lora=pd.LoRARequest("good", bad))
