"""The prefix cache keys pages by the adapter too (its name and a digest of its weights): K/V
computed under one adapter, or the base model, is never served to another; the same adapter
still hits its own pages."""
import pytest

import pagedecode as pd
from pagedecode.runtime.prefix_cache import namespace

from .conftest import PROMPTS, lora

pytest.importorskip("peft")


def test_the_namespace_names_the_adapter_and_its_weights():
    keys = {namespace("m", None), namespace("m", None, ("a", "1")), namespace("m", None, ("a", "2")),
            namespace("m", None, ("b", "1")), namespace("m", "salt", ("a", "1"))}
    assert len(keys) == 5


def test_cached_pages_never_cross_adapters(base, adapters):
    path, _ = base
    prompt = PROMPTS[1] + PROMPTS[0] * 3                  # 33 tokens: 4 full pages of 8
    params = pd.SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0)
    fresh = pd.Engine.from_pretrained(path, page_size=8, max_loras=2, enable_prefix_caching=False)
    want = {name: fresh.generate(prompt, params, lora=lora(adapters, name))[0] for name in (None, "r8", "r64")}
    engine = pd.Engine.from_pretrained(path, page_size=8, max_loras=2)
    seen = set()
    for name in (None, "r8", "r64", None, "r8", "r64"):
        out = engine.generate(prompt, params, lora=lora(adapters, name))[0]
        assert out.selected_token_ids == want[name].selected_token_ids, name
        assert out.logprobs == pytest.approx(want[name].logprobs, abs=1e-5), name
        assert (out.usage.cached_tokens > 0) == (name in seen), name     # its own pages only
        seen.add(name)
    # the same name with other weights is another adapter: no hit
    engine.unload_lora("r8")
    other = engine.generate(prompt, params, lora=pd.LoRARequest("r8", adapters["r64"][0]))[0]
    assert other.usage.cached_tokens == 0 and other.selected_token_ids == want["r64"].selected_token_ids
