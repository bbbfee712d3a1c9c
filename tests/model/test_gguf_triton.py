"""A GGUF model whose layers mix the block types without a Q8_0 / Q4_0 kernel of their own (Q4_1,
Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) on the forward's CUDA path (attention_backend "triton", here in the
interpreter): every such matmul goes through kernels/gguf_matmul.py's GEMV (1 token) or GEMM (5),
and the logits are the dequantizing reference's."""
import collections

import pytest
import torch

import pagedecode as pd
from pagedecode.kernels import gguf_matmul as GM
from pagedecode.kernels._backend import HAS_TRITON, interpreting

from .gguf_files import Q, write_gguf
from .test_gguf import logits_of, tiny  # noqa: F401  (tiny: the random model's fixture)

MIX = {"q_proj": Q.Q5_0, "k_proj": Q.Q4_K, "v_proj": Q.Q8_0, "o_proj": Q.Q5_1, "gate_proj": Q.Q4_K,
       "up_proj": Q.Q4_1, "down_proj": Q.Q6_K, "embed_tokens": Q.Q4_1, "lm_head": Q.Q5_K}


@pytest.mark.skipif(not HAS_TRITON or not interpreting(), reason="needs triton's interpreter")
def test_triton_path_multiplies_every_block_type_with_its_kernel(tiny, monkeypatch):  # noqa: F811
    folder, cfg, weights, meta = tiny
    path = folder / "mix-triton.gguf"
    write_gguf(path, cfg, weights, meta, qtypes=MIX)
    calls: collections.Counter = collections.Counter()
    for name in ("gguf_gemv_triton", "gguf_gemm_triton"):
        real = getattr(GM, name)
        monkeypatch.setattr(GM, name, lambda x, b, kind, *a, _real=real, _name=name, **k:
                            calls.update([(_name, kind)]) or _real(x, b, kind, *a, **k))
    model = pd.Engine.from_pretrained(path, attention_backend="triton").model
    reference = pd.Engine.from_pretrained(path, attention_backend="torch").model
    for ids, kernel in (([7], "gguf_gemv_triton"), ([7, 300, 41, 12, 99], "gguf_gemm_triton")):
        calls.clear()
        got = logits_of(model, ids)
        # per layer: q (Q5_0), k, gate (Q4_K), o (Q5_1), up (Q4_1), down (Q6_K); the head (Q5_K)
        layers = cfg["num_hidden_layers"]
        assert calls == {(kernel, "q5_0"): layers, (kernel, "q4_k"): 2 * layers, (kernel, "q5_1"): layers,
                         (kernel, "q4_1"): layers, (kernel, "q6_k"): layers, (kernel, "q5_k"): 1}
        want = logits_of(reference, ids)
        assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item()
