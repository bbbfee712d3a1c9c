"""Q8_0 / Q4_0 weights kept quantized in memory: the blocks against gguf's own dequantizer, and
`quantization=` on a float checkpoint against the float model (logit error, memory)."""
import numpy as np
import pytest
import torch

import pagedecode as pd
from pagedecode import cli
from pagedecode.model.config import ModelConfig
from pagedecode.model.llama import LlamaModel
from pagedecode.model.quant import QuantizedWeight

from .gguf_files import Q, gguf, random_llama
from .test_gguf import logits_of

STORY = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_blocks_dequantize_as_gguf_does(kind):
    w = torch.randn(7, 96, generator=torch.Generator().manual_seed(0)) * 3
    q = QuantizedWeight.quantize(w, kind)
    assert q.blocks.shape == (7, 3 * (34 if kind == "q8_0" else 18)) and q.nbytes == q.blocks.numel()
    qtype = Q.Q8_0 if kind == "q8_0" else Q.Q4_0
    want = torch.from_numpy(gguf.quants.dequantize(q.blocks.numpy(), qtype))
    assert torch.equal(q.dequantize(), want)
    rows = torch.tensor([5, 0, 5])
    assert torch.equal(q.dequantize(rows=rows), want[rows])
    assert torch.equal(q.select_rows(rows).dequantize(), want[rows])
    # a block's error: half a step (q8_0; q4_0's far side clamps at +7: a whole step), plus the
    # fp16 rounding of the scale
    step = w.abs().reshape(7, 3, 32).amax(-1, keepdim=True) / (127 if kind == "q8_0" else 8)
    assert ((q.dequantize() - w).abs().reshape(7, 3, 32) <= step * (0.6 if kind == "q8_0" else 1.1)).all()


def test_bad_blocks_and_kind_are_refused():
    with pytest.raises(ValueError, match="quantization must be one of"):
        QuantizedWeight("q5_0", torch.zeros(1, 34, dtype=torch.uint8), (1, 32))
    with pytest.raises(ValueError, match="do not hold"):
        QuantizedWeight("q8_0", torch.zeros(2, 34, dtype=torch.uint8), (2, 64))
    with pytest.raises(ValueError, match="quantization must be one of"):
        pd.Engine.from_pretrained("unused", quantization="int8")


# max |logit - float logit| over a 32-token story (logits reach ~22), measured: q8_0 0.196, q4_0 6.9
@pytest.mark.parametrize("kind, max_error, same_greedy", [("q8_0", 0.3, True), ("q4_0", 10.0, False)])
def test_stories_quantized_logits_and_memory(stories_path, kind, max_error, same_greedy):
    dense = pd.Engine.from_pretrained(stories_path, attention_backend="torch")
    engine = pd.Engine.from_pretrained(stories_path, quantization=kind)
    model = engine.model
    assert model.quantized and not model.uses_cpu_extension()      # the torch path until a kernel exists
    assert isinstance(model.layers[0].qkv_w, QuantizedWeight) and model.layers[0].qkv_w.kind == kind
    assert isinstance(model.layers[0].down_w, torch.Tensor)        # 172 inputs: not a multiple of 32
    assert isinstance(model.embed, torch.Tensor)                   # embedding and head keep their type
    ids = engine.tokenizer.encode(STORY)
    error = (logits_of(model, ids) - logits_of(dense.model, ids)).abs().max().item()
    assert 0 < error < max_error
    out = engine.generate("Once upon a time", pd.SamplingParams(max_tokens=16))[0]
    assert out.text.startswith(", there was a little girl") and len(out.token_ids) == 16
    if same_greedy:
        assert out.token_ids == dense.generate("Once upon a time", pd.SamplingParams(max_tokens=16))[0].token_ids
    layer_floats = sum(w.numel() for L in dense.model.layers for w in (L.qkv_w, L.o_w, L.gate_up_w))
    saved = layer_floats * 4 - layer_floats // 32 * (34 if kind == "q8_0" else 18)
    from safetensors.torch import load_file
    checkpoint_bytes = sum(t.numel() * 4 for t in load_file(str(stories_path / "model.safetensors")).values())
    assert engine.weight_bytes == checkpoint_bytes - saved


@pytest.mark.parametrize("kind, max_error", [("q8_0", 0.05), ("q4_0", 0.5)])
def test_random_model_quantized_logits(kind, max_error):
    cfg, weights = random_llama(seed=5)
    config = ModelConfig.from_hf(cfg)
    dense = LlamaModel(config, weights, attention_backend="torch")
    quant = LlamaModel(config, weights, attention_backend="torch", quantization=kind)
    ids = list(range(3, 40))
    ref = logits_of(dense, ids)
    error = (logits_of(quant, ids) - ref).abs().max().item()
    assert 0 < error < max_error * ref.abs().max().item()
    assert quant.weight_bytes < dense.weight_bytes * (0.55 if kind == "q8_0" else 0.45)


def test_cli_quantization_flag(stories_path, capsys):
    assert cli.main(["generate", "--model", str(stories_path), "--quantization", "q8_0",
                     "--prompt", "Once upon a time", "--max-tokens", "16"]) == 0
    assert capsys.readouterr().out.strip() == ", there was a little girl named Lily. She loved to play"


def test_quantized_weights_survive_a_bfloat16_model(stories_path):
    engine = pd.Engine.from_pretrained(stories_path, quantization="q8_0", dtype="bfloat16")
    out = engine.generate("Once upon a time", pd.SamplingParams(max_tokens=8))[0]
    assert len(out.token_ids) == 8 and np.isfinite(out.token_ids).all()
