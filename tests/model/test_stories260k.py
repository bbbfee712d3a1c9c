"""stories260k (a real trained Llama, SentencePiece byte-fallback tokenizer) against the
greedy continuations in its REFERENCE.md, which transformers produced."""
import pytest
import torch

import pagedecode as pd
from pagedecode.testing import prefill_batch

REFERENCE = {
    "Once upon a time": ([1, 403, 407, 261, 378],
                         [432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337, 410, 408,
                          419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394],
                         ", there was a little girl named Lily. She loved to play outside in the park. One day, she saw"),
    "Lily and Tom": ([1, 317, 269, 274, 287],
                     [382, 276, 337, 299, 322, 265, 282, 295, 433, 426, 342, 397, 355, 267, 337, 335, 265, 315, 267,
                      422, 419, 269, 352, 379, 261, 420, 277, 264, 265, 282, 295, 433],
                     " were playing in the park. They liked to play with their toys and run around the park"),
    "The cat": ([1, 291, 280, 294],
                [269, 261, 268, 414, 422, 382, 276, 337, 299, 322, 265, 282, 295, 433, 426, 342, 397, 355, 267, 337,
                 335, 265, 315, 267, 422, 419, 269, 352, 379, 261, 420, 277],
                " and a boy were playing in the park. They liked to play with their toys and run arou"),
}
BOS_ONLY_FIRST_60 = [403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267,
                     337, 410, 408, 419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394, 261, 370,
                     432, 352, 266, 268, 388, 426, 338, 391, 266, 267, 337, 335, 312, 432, 398, 312, 286, 267, 414,
                     270, 333, 415]
TOP5 = {"Once upon a time": [(432, 17.7994), (383, 14.2813), (322, 9.7097), (353, 9.5873), (323, 9.1342)],
        "Lily and Tom": [(382, 13.2909), (261, 11.0917), (263, 9.8683), (269, 9.5641), (343, 9.2731)],
        "The cat": [(269, 11.3171), (286, 11.0879), (397, 10.7879), (381, 9.5945), (263, 9.5938)]}


@pytest.fixture(scope="module")
def engine(stories_engine_factory):
    return stories_engine_factory()


def test_tokenizer_matches_reference_prompt_ids(engine):
    for prompt, (ids, _, _) in REFERENCE.items():
        assert engine.tokenizer.encode(prompt) == ids


@pytest.mark.parametrize("prompt", list(REFERENCE))
def test_greedy_alone(engine, prompt):
    ids, new, text = REFERENCE[prompt]
    out = engine.generate(prompt, pd.SamplingParams(max_tokens=32))[0]
    assert out.prompt_token_ids == ids
    assert out.token_ids == new
    assert out.text == text
    assert out.finish_reason == pd.FinishReason.MAX_OUTPUT_TOKENS


def test_greedy_in_a_batch_with_other_lengths(stories_engine_factory):
    engine = stories_engine_factory(max_tokens_per_step=7, page_size=8)   # chunked prefill too
    fillers = ["A", "Tom had a big red ball and a small blue car. He", "Sue"]
    prompts = list(REFERENCE) + fillers
    params = [pd.SamplingParams(max_tokens=32)] * 3 + [pd.SamplingParams(max_tokens=n) for n in (5, 40, 17)]
    outs = engine.generate(prompts, params)
    for out, prompt in zip(outs, REFERENCE):
        assert out.token_ids == REFERENCE[prompt][1]
    assert [len(o.token_ids) for o in outs[3:]] == [5, 40, 17]
    engine.pool.check_integrity()
    assert engine.pool.free_pages == engine.pool.num_pages


def test_from_bos_alone_reproduces_llama2c(engine):
    out = engine.generate([[1]], pd.SamplingParams(max_tokens=60))[0]
    assert out.token_ids == BOS_ONLY_FIRST_60
    assert out.text.startswith("Once upon a time, there was a little girl named Lily.")


def test_first_step_logits(engine):
    model = engine.model
    for prompt, top in TOP5.items():
        ids = REFERENCE[prompt][0]
        kv = pd.KVCache(model.config.num_layers, 1, 16, model.config.num_kv_heads, model.config.head_dim,
                        torch.float32)
        logits = model.forward(prefill_batch(ids, pages=[0], page_size=16, all_logits=False), kv)[0]
        values, idx = logits.topk(5)
        assert idx.tolist() == [t for t, _ in top]
        torch.testing.assert_close(values, torch.tensor([v for _, v in top]), atol=2e-4, rtol=0)


@pytest.mark.parametrize("kv", ["float16", "bfloat16"])
def test_a_16_bit_kv_cache_keeps_the_reference_continuations(stories_engine_factory, kv):
    """kv_cache_dtype halves the cache of the float32 model (the same budget holds twice the
    tokens) and, on this model, changes none of the greedy tokens, in a batch with chunked prefill."""
    budget = 1 << 20
    plain = stories_engine_factory(memory_budget_bytes=budget)
    engine = stories_engine_factory(kv_cache_dtype=kv, memory_budget_bytes=budget, max_tokens_per_step=7)
    assert engine.kv.k.dtype == engine.kv.v.dtype == getattr(torch, kv)
    assert engine.bytes_per_token * 2 == plain.bytes_per_token
    assert engine.pool.num_pages == 2 * plain.pool.num_pages
    assert engine.model._compiled is not None and engine.model._compiled.runs(engine.kv)
    outs = engine.generate(list(REFERENCE) + [[1]], pd.SamplingParams(max_tokens=32))
    for out, prompt in zip(outs, REFERENCE):
        assert (out.token_ids, out.text) == REFERENCE[prompt][1:]
    assert outs[-1].token_ids == BOS_ONLY_FIRST_60[:32]
    # the first step's logits: within the cache's rounding of float32's
    want = plain.generate("The cat", pd.SamplingParams(max_tokens=1, logprobs=5))[0].top_logprobs[0]
    got = engine.generate("The cat", pd.SamplingParams(max_tokens=1, logprobs=5))[0].top_logprobs[0]
    assert [t for t, _ in got] == [t for t, _ in want]
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, want)) < 0.05
