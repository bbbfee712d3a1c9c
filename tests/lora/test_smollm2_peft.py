"""SmolLM2-135M-Instruct (the real model, its GGUF's values in float32) under a peft adapter of
rank 8 on all seven modules: logits within 1e-4 of transformers + peft, greedy tokens identical
(a few tokens: the model is 30 layers)."""
import pytest
import torch

import pagedecode as pd
from pagedecode.model.gguf_file import read_gguf
from pagedecode.model.gguf_tokenizer import build_tokenizer
from pagedecode.model.quant import QuantizedWeight

from .helpers import peft_adapter

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")


@pytest.fixture(scope="module")
def smollm2_float(smollm2_path):
    """(pd.LlamaModel, transformers' LlamaForCausalLM, tokenizer) over the same float32 values."""
    config, weights, meta = read_gguf(smollm2_path)
    dense = {k: (w.dequantize() if isinstance(w, QuantizedWeight) else w).float() for k, w in weights.items()}
    c = config
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, tie_word_embeddings="lm_head.weight" not in dense)
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    missing, unexpected = hf.load_state_dict(dense, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    hf.tie_weights()
    model = pd.LlamaModel(config, dense)
    del dense
    return model, hf, build_tokenizer(meta)


def test_smollm2_under_a_peft_adapter_matches_transformers(smollm2_float, tmp_path):
    model, hf, tokenizer = smollm2_float
    reference = peft_adapter(hf, tmp_path / "smol-r8", r=8, alpha=16, std=0.02, copy=False)
    ids = tokenizer.encode("The capital of France is")
    engine = pd.Engine(model, tokenizer, pd.EngineConfig(max_loras=1, max_lora_rank=8, page_size=8))
    request = pd.LoRARequest("smol-r8", tmp_path / "smol-r8")
    out = engine.generate(ids, pd.SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=0),
                          lora=request)[0]
    with torch.no_grad():
        ref = torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), -1)
        want = reference.generate(input_ids=torch.tensor([ids]), max_new_tokens=4, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert out.selected_token_ids == want
    # each prompt token's logprob under the adapter: the logits of every prompt position
    scored = torch.tensor(out.prompt_logprobs[1:])
    expected = ref[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert (scored - expected).abs().max().item() < 1e-4
