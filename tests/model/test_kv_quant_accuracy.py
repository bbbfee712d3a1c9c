"""8-bit KV caches on the real model: benchmarks/kv_quant.py's accuracy measurement, reduced (2 chat
prompts x 32 tokens, teacher-forced, SmolLM2-135M-Instruct's weights dequantized to float32 so that
no activation rounding hides the cache's error), against the float32 cache.

Measured (2026-12-06): float16 3.6e-7, int8 1.0e-3, fp8_e4m3 2.6e-3 (4.6e-3 before fp8's scale
search); with bfloat16 scales (1.94x float16's tokens) int8 9.2e-4, fp8_e4m3 1.9e-3. Issue 40
asks <= 1e-3 for both: int8 sits at it, fp8 (3 mantissa bits, one scale per token and head) is
2-2.6x over it. The bounds below guard what holds (and that the measurement tells the caches
apart); they are not the issue's bound for fp8."""
import sys
from pathlib import Path

import pytest

import pagedecode as pd
from pagedecode.model.gguf_file import read_gguf
from pagedecode.model.llama import LlamaModel
from pagedecode.model.quant import QuantizedWeight
from pagedecode.server.chat import ChatTemplate, load_template

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import kv_quant  # noqa: E402


@pytest.fixture(scope="module")
def dense_smollm2(smollm2_path):
    config, weights, _ = read_gguf(smollm2_path)
    model = LlamaModel(config, {k: w.dequantize() if isinstance(w, QuantizedWeight) else w
                                for k, w in weights.items()})
    _, tokenizer = pd.load_model(smollm2_path)
    engine = pd.Engine(model, tokenizer, pd.EngineConfig(enable_prefix_caching=False))
    yield engine
    engine.close()


def test_teacher_forced_kl_of_8_bit_caches(dense_smollm2, smollm2_path):
    source, specials = load_template(smollm2_path)
    template = ChatTemplate(source, specials)
    prompts = [template.render([{"role": "user", "content": p}]) for p in kv_quant.PROMPTS[:2]]
    got = {c: r["mean_kl"] for c, r in kv_quant.kl_by_cache(dense_smollm2, prompts, 32,
                                                             ["float16", "int8", "fp8_e4m3"]).items()}
    assert got["float16"] < 1e-5, got
    assert 1e-4 < got["int8"] <= 2 * kv_quant.KL_BOUND, got
    assert got["int8"] < got["fp8_e4m3"] <= 3.5 * kv_quant.KL_BOUND, got     # 4.6e-3 without the scale search
