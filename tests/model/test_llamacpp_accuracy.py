"""The real model against llama.cpp on the same file (issue 35, item 6, at reduced size; the full
measurement, every type, is benchmarks/llamacpp_accuracy.py): the same token ids for the chat
prompts and the text, next-token distributions teacher-forced as close to llama.cpp's as llama.cpp's
own are to each other, perplexity equal to llama-perplexity's. Each test skips, naming the llama.cpp
tool, where benchmarks/peers/llamacpp.sh has not built it.

Why not KL <= 1e-3: the int8 activations (Q8_0 / Q8_1 per 32 inputs, as llama.cpp rounds them)
turn a change in the last bit of any float into whole rounding steps downstream. pagedecode against
itself with one float32 ulp moved in its first layer's norm weights is KL 7.2e-3 on SmolLM2's Q4_1
file and 4.8e-3 on its Q8_0 file (2 chat prompts x 32 tokens), as far as it is from llama.cpp
(5.7e-3 / 7.9e-3 with both caches in float32) and llama.cpp from itself with its cache moved from
float16 to float32 (4.8e-3 / 8.1e-3). Without the rounding -- the float32 file -- pagedecode is
llama.cpp to KL 2.5e-11 with the same greedy tokens (the first test): the model's arithmetic is
llama.cpp's, and a bound under the rounding's own floor asks for llama.cpp's float operations bit
for bit."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

import pagedecode as pd
from pagedecode.server.chat import ChatTemplate, load_template

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import llamacpp_accuracy as acc  # noqa: E402
import llamacpp_files as lf  # noqa: E402
from real_model import smollm2_f32_gguf  # noqa: E402

NOISE_FLOOR = 3.3e-3     # mean KL(llama.cpp float16 cache || llama.cpp float32 cache), measured (above)
ISSUE_BOUND = 1e-3       # issue 35's KL bound


def need(*tools: str) -> None:
    why = lf.missing(*tools)
    if why:
        pytest.skip(why)


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    engine = pd.Engine.from_pretrained(smollm2_path, num_threads=2)
    yield engine
    engine.close()


def test_chat_prompts_and_the_text_are_llama_cpps_token_ids(smollm2, smollm2_path):
    """The rendered chat (special tokens read as such) and the perplexity text: every id equal."""
    need("llama-tokenize")
    template = ChatTemplate(*load_template(smollm2_path))
    for question, ids in zip(acc.QUESTIONS, acc.chat_prompts(smollm2, smollm2_path, len(acc.QUESTIONS))):
        text = template.render([{"role": "user", "content": question}])
        assert lf.tokenize(smollm2_path, text, special=True) == ids, question
    text = acc.public_domain_text()
    ids = smollm2.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) >= 2000
    assert lf.tokenize(smollm2_path, text) == ids


def test_float32_file_is_llama_cpps_model(smollm2_path):
    """SmolLM2's weights in float32, both engines on a float32 KV cache (llama.cpp without flash
    attention): nothing is rounded to 8 bits, and the distributions are llama.cpp's to float32's
    rounding (KL 2.5e-11 measured), the argmaxes and the free-running greedy tokens the same. A
    wrong RoPE, norm epsilon, attention scale, template id or head is KL 0.1 and more."""
    need("pd-greedy", "pd-logits")
    model = smollm2_f32_gguf()
    engine = pd.Engine.from_pretrained(model, num_threads=2, kv_cache_dtype="float32")
    reference = pd.Engine.from_pretrained(model, num_threads=2, attention_backend="torch")
    try:
        prompts = acc.chat_prompts(engine, model, 2)
        got = acc.teacher_forced(engine, reference, model, prompts, 32, threads=1)
        ours = [list(o.token_ids) for o in engine.generate(prompts, pd.SamplingParams(max_tokens=32, ignore_eos=True))]
    finally:
        engine.close()
        reference.close()
    assert got["vs_llamacpp_f32_cache"]["mean_kl"] <= 1e-8, got
    assert got["vs_llamacpp_f32_cache"]["argmax_agreement"] == 1.0, got
    assert got["pagedecode_one_ulp_moved"]["mean_kl"] <= 1e-8, got    # no rounding, no amplification
    assert ours == lf.greedy(model, prompts, 32, 1, kv="f32", flash="off")


def test_q4_1_file_teacher_forced_against_llama_cpp(smollm2, smollm2_path):
    """Within twice llama.cpp's distance from itself (a wrong RoPE base, norm epsilon, head or
    activation rounding is KL 0.1 and more), and as close to float activations as llama.cpp is."""
    need("pd-greedy", "pd-logits")
    reference = pd.Engine.from_pretrained(smollm2_path, num_threads=2, attention_backend="torch")
    try:
        got = acc.teacher_forced(smollm2, reference, smollm2_path, acc.chat_prompts(smollm2, smollm2_path, 2), 32,
                                 threads=1)
    finally:
        reference.close()
    floor = max(got["llamacpp_f16_vs_f32_cache"]["mean_kl"], NOISE_FLOOR)
    assert got["mean_kl"] <= 2 * floor, got
    # the rounding's own floor: one ulp moved in pagedecode is already past the issue's bound, and
    # llama.cpp on pagedecode's float32 cache is no farther than that
    ulp = got["pagedecode_one_ulp_moved"]["mean_kl"]
    assert ulp > ISSUE_BOUND, got
    assert got["vs_llamacpp_f32_cache"]["mean_kl"] <= 2 * max(ulp, NOISE_FLOOR), got
    assert got["argmax_agreement"] >= 0.9, got
    ref = got["vs_float_activations"]
    assert ref["pagedecode_mean_kl"] <= 1.5 * ref["llamacpp_mean_kl"] + 1e-3, got


def test_q4_1_file_perplexity_equals_llama_perplexity(smollm2, smollm2_path):
    """Two windows of 128 tokens of tests/data/public_domain.txt, each scored on its second half,
    over llama.cpp's token ids. Within 2%, not the issue's 1%: the engines' ~3e-3 KL per position
    (above) moves a mean log-likelihood over 126 tokens by about 1% either way (two windows of 256
    measured 1.0%)."""
    need("llama-tokenize", "llama-perplexity")
    got = acc.perplexities(smollm2, smollm2_path, n_ctx=128, chunks=2, threads=1)
    assert got["same_tokens_as_pagedecode"]
    assert abs(got["ratio"] - 1) < 0.02, got
