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


def dequantized(w):
    """A quantized weight's float32 values, gguf's exactly (the compiled rows kernel: seconds, where
    QuantizedWeight.dequantize in torch takes tens of them for 135M weights)."""
    from pagedecode.model.cpu_forward import cpu_ext
    ext = cpu_ext()
    if ext is None:
        return w.dequantize().float()
    return ext.quant_embedding_rows(w.kernel_blocks(), torch.arange(w.shape[0]), w.shape[1])


@pytest.fixture(scope="module")
def smollm2_float(smollm2_path):
    """(pd.LlamaModel, transformers' LlamaForCausalLM, tokenizer) over the same float32 values."""
    config, weights, meta = read_gguf(smollm2_path)
    dense = {k: dequantized(w) if isinstance(w, QuantizedWeight) else w.float() for k, w in weights.items()}
    c = config
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, tie_word_embeddings="lm_head.weight" not in dense)
    with torch.device("meta"):                       # no random initialisation of 135M weights first
        hf = transformers.LlamaForCausalLM(hf_config).eval()
    missing, unexpected = hf.load_state_dict(dense, strict=False, assign=True)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    hf.model.rotary_emb = type(hf.model.rotary_emb)(hf_config)      # its tables are buffers, not weights
    hf.tie_weights()
    assert not any(t.is_meta for t in [*hf.parameters(), *hf.buffers()])
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
    # one forward over the prompt and our tokens (teacher forcing): its greedy choice at each
    # position is what transformers' generate would select, given the same tokens before it
    full = ids + out.selected_token_ids
    with torch.no_grad():
        ref = torch.log_softmax(reference(torch.tensor([full])).logits[0].float(), -1)
    assert out.selected_token_ids == ref[len(ids) - 1:-1].argmax(-1).tolist()
    # each prompt token's logprob under the adapter: the logits of every prompt position
    scored = torch.tensor(out.prompt_logprobs[1:])
    expected = ref[:len(ids) - 1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert (scored - expected).abs().max().item() < 1e-4
