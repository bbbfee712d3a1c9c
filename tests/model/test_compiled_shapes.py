"""The compiled CPU forward checks what it is handed before it indexes (issue 34, item 1): weights
whose shapes disagree with the model's heads and sizes are refused when the forward's Stack is built,
naming the tensor, and a batch whose indices point outside the model or the cache is refused before
any kernel reads through them. Each case runs in its own process, so a crash (SIGSEGV, glibc's
abort on a corrupted heap) fails the test instead of killing pytest."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pagedecode.model.cpu_forward import cpu_extension_available

pytestmark = pytest.mark.skipif(not cpu_extension_available(), reason="pagedecode._cpu not built")
ROOT = Path(__file__).resolve().parents[2]

SETUP = textwrap.dedent("""
    import random, sys, torch
    sys.path.insert(0, {tests!r})
    from model.test_cpu_extension import mixed_batch, random_model
    from pagedecode.model.kv_cache import KVCache
    from pagedecode.model import cpu_forward
    model = random_model(torch.float32, heads=4, kv_heads=2, head_dim=32)
    c = model.config
    stack = model._compiled
    def kv(pages=8, kv_heads=c.num_kv_heads, head_dim=c.head_dim, layers=c.num_layers):
        return KVCache(layers, pages, 16, kv_heads, head_dim, torch.float32)
    def batch():
        return mixed_batch(random.Random(0), 16, [[3], [1, 2]], [(0, 1), (5, 12)])
    def rebuild(**slots):      # the forward's Stack over layer 0's slots with some replaced
        stack.layer_slots[0].update(slots)
        return stack._stack()
""")


def run_case(body: str) -> subprocess.CompletedProcess:
    code = (SETUP.format(tests=str(ROOT / "tests")) + "try:\n" + textwrap.indent(textwrap.dedent(body), "    ")
            + "\nexcept RuntimeError as e:\n    print('REFUSED:', str(e).splitlines()[0])\n    sys.exit(3)\n"
            + "print('ACCEPTED')\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=None)


def refused(body: str, *words: str) -> None:
    p = run_case(body)
    assert p.returncode == 3, f"exit {p.returncode} (negative: killed by a signal)\n{p.stdout}\n{p.stderr[-2000:]}"
    for w in words:
        assert w in p.stdout, p.stdout


def test_a_well_formed_call_is_accepted():
    """The harness itself: the model as loaded runs (so a refusal below is the check's doing)."""
    p = run_case("logits = stack.forward(batch(), kv())\nassert logits.shape == (2, c.vocab_size)\n")
    assert p.returncode == 0 and "ACCEPTED" in p.stdout, p.stdout + p.stderr[-2000:]


@pytest.mark.parametrize("case,words", [
    # q_proj with half its rows: qkv stacked from 64 + 64 + 64 rows where 128 + 64 + 64 are expected
    ("rebuild(qkv_w=stack.layer_slots[0]['qkv_w'][64:].contiguous(), qkv_b=torch.empty(0), qkv_t=torch.empty(0))",
     ["layer 0 qkv_w", "(256, 128)", "[192, 128]"]),
    ("rebuild(o_w=torch.zeros(128, 64))", ["layer 0 o_w", "(128, 128)"]),
    ("rebuild(down_w=torch.zeros(128, 36))", ["layer 0 down_w", "(128, 72)"]),
    ("rebuild(qkv_b=torch.zeros(7))", ["layer 0 qkv_b"]),
    ("rebuild(ln2=torch.zeros(64))", ["layer 0 ln2"]),
    ("rebuild(o_t=torch.zeros(3, 3))", ["layer 0 o_w transposed"]),
    ("rebuild(qkv_w=stack.layer_slots[0]['qkv_w'].to(torch.bfloat16))", ["layer 0 qkv_w"]),
])
def test_a_weight_that_disagrees_with_the_shapes_is_refused_naming_it(case, words):
    refused(case, *words)


def test_a_model_whose_kv_heads_disagree_with_its_tensors_is_refused():
    """num_key_value_heads 4 over tensors that hold 2 (a config.json that lies): the compiled
    forward's Stack refuses the model's qkv rows at load, before any forward."""
    refused("""
        from pagedecode.model.llama import LlamaModel
        from dataclasses import replace
        weights = {}
        for i, L in enumerate(model.layers):
            p = f"model.layers.{i}."
            q, k, v = L.qkv_w.split([128, 64, 64])
            weights.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                            p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": L.o_w,
                            p + "input_layernorm.weight": L.ln1, p + "post_attention_layernorm.weight": L.ln2,
                            p + "mlp.gate_proj.weight": L.gate_up_w[:72], p + "mlp.up_proj.weight": L.gate_up_w[72:],
                            p + "mlp.down_proj.weight": L.down_w})
        weights.update({"model.embed_tokens.weight": model.embed, "model.norm.weight": model.final_norm,
                        "lm_head.weight": model.lm_head})
        LlamaModel(replace(c, num_kv_heads=4), weights)
    """, "qkv_w", "(384, 128)")


@pytest.mark.parametrize("case,words", [
    ("b = batch(); b.input_ids[0] = c.vocab_size; stack.forward(b, kv())", ["token id"]),
    ("b = batch(); b.positions[3] = 10_000; stack.forward(b, kv())", ["position"]),
    ("b = batch(); b.slot_mapping[1] = 8 * 16; stack.forward(b, kv())", ["cache slot"]),
    ("b = batch(); b.page_table[1, 0] = 8; stack.forward(b, kv())", ["outside the cache"]),
    ("b = batch(); b.seq_lens[1] = 1000; stack.forward(b, kv())", ["fit its pages"]),
    ("b = batch(); b.cu_q[2] = 40; stack.forward(b, kv())", ["cu_q"]),
    ("b = batch(); b.logits_indices[1] = 99; stack.forward(b, kv())", ["logits row"]),
    ("stack.forward(batch(), kv(kv_heads=4))", ["K and V caches"]),       # a cache with the wrong kv-head count
    ("stack.forward(batch(), kv(head_dim=16))", ["K and V caches"]),
    ("stack.forward(batch(), kv(layers=1))", ["K and V caches"]),
])
def test_a_batch_that_points_outside_the_model_or_cache_is_refused(case, words):
    refused(case, *words)
