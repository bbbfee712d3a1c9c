"""8-bit KV caches on the real model: benchmarks/kv_quant.py's accuracy measurement, reduced (2 chat
prompts x 32 tokens, teacher-forced), holds its bound -- mean KL against the float32 cache
<= 1e-3 for int8 and fp8_e4m3 -- and the float16 cache sits below both (the measurement can tell
caches apart)."""
import sys
from pathlib import Path

import pytest

import pagedecode as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import kv_quant  # noqa: E402


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    engine = pd.Engine.from_pretrained(smollm2_path, enable_prefix_caching=False)
    yield engine
    engine.close()


def test_teacher_forced_kl_of_8_bit_caches_within_the_bound(smollm2, smollm2_path):
    from pagedecode.server.chat import ChatTemplate, load_template
    source, specials = load_template(smollm2_path)
    template = ChatTemplate(source, specials)
    prompts = [template.render([{"role": "user", "content": p}]) for p in kv_quant.PROMPTS[:2]]
    got = kv_quant.kl_by_cache(smollm2, prompts, 32, ["float16", "int8", "fp8_e4m3"])
    for cache in ("int8", "fp8_e4m3"):
        assert 0 < got[cache]["mean_kl"] <= kv_quant.KL_BOUND, (cache, got[cache])
        assert got["float16"]["mean_kl"] < got[cache]["mean_kl"], got
    assert got["int8"]["mean_kl"] < got["fp8_e4m3"]["mean_kl"]
