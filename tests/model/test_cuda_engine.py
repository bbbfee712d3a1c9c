"""The engine on CUDA runs the Triton kernels; its choices match the CPU reference path.
Skips without CUDA (the device check runs it on the lent GPU)."""
import pytest
import torch

import pagedecode as pd
from pagedecode.kernels._backend import HAS_TRITON, interpreting

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON or interpreting(),
                                reason="needs CUDA and compiled Triton")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    import os
    os.environ["PAGEDECODE_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    from pagedecode.model.default_model import default_model_path
    return default_model_path()


def test_engine_on_cuda_matches_the_reference_path(model_path):
    prompts = ["The lighthouse keeper", "A small river ran past the mill. In spring it was loud", "Numbers"]
    params = pd.SamplingParams(max_tokens=12, logprobs=0, ignore_eos=True)
    cpu = pd.Engine.from_pretrained(model_path).generate(prompts, params)
    gpu_engine = pd.Engine.from_pretrained(model_path, device="cuda", dtype="float32", page_size=16)
    assert gpu_engine.kv.k.is_cuda
    gpu = gpu_engine.generate(prompts, params)
    for a, b in zip(cpu, gpu):
        assert b.state == pd.RequestState.FINISHED
        assert b.selected_token_ids == a.selected_token_ids            # every token, not the first
        assert all(abs(x - y) < 1e-2 for x, y in zip(a.logprobs, b.logprobs))
    assert gpu_engine.pool.free_pages == gpu_engine.pool.num_pages


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_quantized_engine_on_cuda_matches_the_dequantizing_reference(model_path, kind):
    """Quantized layers on CUDA go through kernels/quant_matmul.py (GEMV for the decode steps,
    GEMM for the prompts); the CPU reference dequantizes each weight per call."""
    pytest.importorskip("gguf")                                    # the quantizer
    prompts = ["The lighthouse keeper", "A small river ran past the mill. In spring it was loud", "Numbers"]
    params = pd.SamplingParams(max_tokens=12, logprobs=0, ignore_eos=True)
    cpu = pd.Engine.from_pretrained(model_path, quantization=kind, attention_backend="torch").generate(prompts, params)
    gpu_engine = pd.Engine.from_pretrained(model_path, device="cuda", dtype="float32", quantization=kind)
    assert gpu_engine.model.quantized and gpu_engine.model.layers[0].qkv_w.device.type == "cuda"
    for a, b in zip(cpu, gpu_engine.generate(prompts, params)):
        assert b.state == pd.RequestState.FINISHED
        assert b.selected_token_ids == a.selected_token_ids
        assert all(abs(x - y) < 1e-2 for x, y in zip(a.logprobs, b.logprobs))
