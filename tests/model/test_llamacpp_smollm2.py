"""The real model against llama.cpp on the same files: SmolLM2-135M-Instruct's own Q4_1 GGUF and
llama-quantize's requantizations of it (from an F32 copy of its values), each decoded greedily
by both engines from the same chat prompts (llama.cpp through benchmarks/peers/greedy.cpp, 2
threads). Skips unless llama.cpp is built (benchmarks/peers/llamacpp.sh)."""
import pytest

import pagedecode as pd
from pagedecode.server.chat import ChatTemplate, load_template

from .llamacpp_files import llamacpp_bin, llamacpp_greedy, quantized_file

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Give me three tips for learning to cook.", "Explain what a CPU does in one paragraph."]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def bin_dir():
    folder = llamacpp_bin()
    if folder is None:
        pytest.skip("llama.cpp is not built (benchmarks/peers/llamacpp.sh; or LLAMACPP_BIN=folder)")
    return folder


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> float:
    same = sum(a == b for x, y in zip(ours, theirs) for a, b in zip(x, y))
    return same / sum(len(x) for x in ours)


@pytest.mark.parametrize("kind", ["q4_1", "q5_0", "q5_1", "q8_0", "q4_k_m"])
def test_greedy_tokens_agree_with_llama_cpp(smollm2_path, bin_dir, kind):
    path = smollm2_path if kind == "q4_1" else quantized_file(smollm2_path, kind, bin_dir)
    engine = pd.Engine.from_pretrained(path)
    template = ChatTemplate(*load_template(path))
    prompts = [engine.tokenizer.encode(template.render([{"role": "user", "content": q}])) for q in QUESTIONS]
    ours = [o.token_ids for o in engine.generate(prompts, pd.SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))]
    theirs = llamacpp_greedy(path, prompts, NEW_TOKENS, bin_dir)
    assert agreement(ours, theirs) >= 0.95, (kind, agreement(ours, theirs))
