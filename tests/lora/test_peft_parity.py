"""Adapters made by peft (random non-zero A and B, ranks 8 and 64, all seven modules) on the
built-in random model: logits within 1e-4 of transformers + peft in float32 and greedy tokens
identical, on the compiled CPU forward and the torch path; a batch mixing three adapters and
the base equals each run alone (bit for bit in deterministic mode); speculation verifies under
the request's adapter; what cannot run adapters refuses them by name."""
import pytest
import torch

import pagedecode as pd
from pagedecode.lora.adapter import load_adapter
from pagedecode.lora.manager import refusal
from pagedecode.lora.stacks import LoRABatch, LoRAStacks
from pagedecode.testing import ScriptedModel, prefill_batch

from .conftest import PROMPTS, lora

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

BACKENDS = ["auto", "torch"]          # the compiled CPU forward, the torch ops


def hf_greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def forward_under(model, stacks, slot, ids, all_logits):
    batch = prefill_batch(ids, pages=[3, 0, 2], page_size=8, all_logits=all_logits)
    batch.lora = LoRABatch(stacks, torch.tensor([0, len(ids)], dtype=torch.int32),
                           torch.tensor([slot], dtype=torch.int32))
    c = model.config
    kv = pd.KVCache(c.num_layers, 4, 8, c.num_kv_heads, c.head_dim, torch.float32)
    return model.forward(batch, kv)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["r8", "r64"])
def test_logits_match_transformers_and_peft(base, adapters, name, backend):
    path, hf = base
    folder, reference = adapters[name]
    model, _ = pd.load_model(path, attention_backend=backend)
    assert model.uses_cpu_extension() == (backend == "auto")
    stacks = LoRAStacks(model.config, 2, 64, torch.float32, torch.device("cpu"))
    stacks.write(1, load_adapter(name, folder, model.config, 64))
    ids = PROMPTS[1]
    with torch.no_grad():
        ref = reference(torch.tensor([ids])).logits[0].float()
        plain = hf(torch.tensor([ids])).logits[0].float()
    assert (ref - plain).abs().max() > 0.1                     # the adapter moves the logits
    for all_logits in (True, False):                           # every row; the last only (its trimmed layer)
        ours = forward_under(model, stacks, 1, ids, all_logits)
        want = ref if all_logits else ref[-1:]
        assert (ours - want).abs().max().item() < 1e-4, (ours - want).abs().max().item()


@pytest.mark.parametrize("backend,deterministic", [("auto", False), ("torch", False), ("auto", True)])
def test_greedy_tokens_match_transformers_and_peft(base, adapters, backend, deterministic):
    path, _ = base
    engine = pd.Engine.from_pretrained(path, attention_backend=backend, page_size=8, max_tokens_per_step=11,
                                       max_loras=2, deterministic=deterministic)
    for name in ("r8", "r64"):
        outs = engine.generate(PROMPTS, pd.SamplingParams(max_tokens=12, ignore_eos=True), lora=lora(adapters, name))
        for ids, out in zip(PROMPTS, outs):
            assert out.selected_token_ids == hf_greedy(adapters[name][1], ids, 12), name


MIX = [None, "r8", "r64", "qvd8"]


@pytest.mark.parametrize("backend,deterministic,max_loras", [("auto", False, 3), ("torch", False, 3),
                                                            ("auto", True, 3), ("torch", True, 3),
                                                            ("auto", False, 1)])
def test_a_batch_mixing_three_adapters_and_the_base_equals_each_alone(base, adapters, backend, deterministic,
                                                                      max_loras):
    """Two prompts under each of the four, in one generate (decode rows, prefill chunks and
    adapters interleaved); max_loras=1: the adapters take turns in the one slot."""
    path, _ = base
    engine = pd.Engine.from_pretrained(path, attention_backend=backend, page_size=8, max_tokens_per_step=16,
                                       max_loras=max_loras, deterministic=deterministic,
                                       enable_prefix_caching=False)
    params = pd.SamplingParams(max_tokens=8, ignore_eos=True, logprobs=0)
    prompts = [PROMPTS[0]] * 4 + [PROMPTS[1]] * 4
    names = MIX + MIX[::-1]
    mixed = engine.generate(prompts, params, lora=[lora(adapters, n) for n in names])
    assert len({tuple(o.selected_token_ids) for o in mixed[:4]}) > 1      # the adapters change the tokens
    for prompt, name, out in zip(prompts, names, mixed):
        alone = engine.generate(prompt, params, lora=lora(adapters, name))[0]
        assert alone.selected_token_ids == out.selected_token_ids, name
        if deterministic:
            assert alone.logprobs == out.logprobs, name
        else:
            assert alone.logprobs == pytest.approx(out.logprobs, abs=1e-4), name
    assert engine.lora.residency.loads >= (3 if max_loras == 3 else 4)


@pytest.mark.parametrize("method", ["prediction", "draft"])
def test_speculation_verifies_under_the_requests_adapter(base, adapters, method):
    """The drafts (a Predicted Output: the tokens themselves; or the base model as draft model)
    are verified by the target under the adapter: the same tokens as without speculation."""
    path, _ = base
    prompt = PROMPTS[1]
    params = pd.SamplingParams(max_tokens=12, ignore_eos=True)
    want = hf_greedy(adapters["r8"][1], prompt, 12)
    plain = pd.Engine.from_pretrained(path, max_loras=1).generate(prompt, params, lora=lora(adapters, "r8"))[0]
    assert plain.selected_token_ids == want
    if method == "draft":
        spec = pd.SpeculativeConfig(method="draft", num_tokens=3, min_acceptance=0.0, min_gain=0.0, draft_model=path)
        engine = pd.Engine.from_pretrained(path, max_loras=1, speculative=spec)
    else:
        engine = pd.Engine.from_pretrained(path, max_loras=1)
        params = pd.SamplingParams(max_tokens=12, ignore_eos=True, prediction=want)
    out = engine.generate(prompt, params, lora=lora(adapters, "r8"))[0]
    assert out.usage.draft_tokens > 0
    assert out.selected_token_ids == want
    if method == "prediction":
        assert out.usage.accepted_prediction_tokens > 0      # the adapter's tokens, accepted as drafts


def test_what_cannot_run_adapters_refuses_them_by_name(base, adapters):
    class Sharded:
        world, applies_lora = 2, True
    assert "tensor-parallel model (tensor_parallel_size=2)" in refusal(Sharded())
    engine = pd.Engine(ScriptedModel([5, 6, 7], vocab_size=32), pd.testing.ByteVocabTokenizer({i: b"x" for i in range(32)}))
    with pytest.raises(pd.AdapterError, match="'r8'.*ScriptedModel.*does not apply LoRA adapters"):
        engine.generate([1, 2], pd.SamplingParams(max_tokens=2), lora=lora(adapters, "r8"))
    off = pd.Engine.from_pretrained(base[0], max_loras=0)
    with pytest.raises(pd.AdapterError, match="'r8'.*max_loras=0"):
        off.generate([1, 2], pd.SamplingParams(max_tokens=2), lora=lora(adapters, "r8"))
