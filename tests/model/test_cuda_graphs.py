"""Decode CUDA graphs (model/cuda_graphs.py). On CPU: the buckets, which steps replay, the padding
and its masking, the memory bound and the options, with a capture that replays eagerly. On a GPU
(skipped without CUDA): graph replay and the eager forward give the same bits."""
import logging
import random

import pytest
import torch

import pagedecode as pd
from pagedecode.kernels._backend import HAS_TRITON, interpreting
from pagedecode.model.batch import ForwardBatch
from pagedecode.model.cuda_graphs import (DecodeGraphs, StaticDecodeInputs, bucket_for, decode_buckets,
                                          decode_graphs, graphable)
from pagedecode.model.kv_cache import KVCache

from .test_cpu_extension import random_model

PAGE = 8


def test_buckets_are_powers_of_two_up_to_the_batch_size():
    assert decode_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert decode_buckets(48) == (1, 2, 4, 8, 16, 32, 48)
    assert decode_buckets(1) == (1,)
    buckets = decode_buckets(64)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 17, 33, 64, 65)] == [1, 2, 4, 8, 32, 64, 64, None]


class Pool:
    """Sequences over one KV cache with shuffled pages; builds decode and prefill batches."""

    def __init__(self, model, num_pages=64, seed=0):
        self.kv = KVCache(model.config.num_layers, num_pages, PAGE, model.config.num_kv_heads, model.config.head_dim,
                          model.dtype, device=model.device)
        self.free = list(range(num_pages))
        random.Random(seed).shuffle(self.free)
        self.pages: list[list[int]] = []
        self.lens: list[int] = []

    def batch(self, parts: list[list[int]], seqs: list[int], device) -> ForwardBatch:
        ids, pos, slots, cu = [], [], [], [0]
        for s, tokens in zip(seqs, parts):
            while len(self.pages) <= s:
                self.pages.append([])
                self.lens.append(0)
            c = self.lens[s]
            while len(self.pages[s]) * PAGE < c + len(tokens):
                self.pages[s].append(self.free.pop())
            for i, t in enumerate(tokens):
                ids.append(t)
                pos.append(c + i)
                slots.append(self.pages[s][(c + i) // PAGE] * PAGE + (c + i) % PAGE)
            cu.append(cu[-1] + len(tokens))
            self.lens[s] = c + len(tokens)
        width = max(len(self.pages[s]) for s in seqs)
        table = [self.pages[s] + [-1] * (width - len(self.pages[s])) for s in seqs]
        decode = sum(1 for t in parts if len(t) == 1)
        last = torch.tensor(cu[1:]) - 1
        return ForwardBatch(torch.tensor(ids, device=device), torch.tensor(pos, device=device),
                            torch.tensor(slots, device=device), torch.tensor(table, dtype=torch.int32, device=device),
                            torch.tensor([self.lens[s] for s in seqs], dtype=torch.int32, device=device),
                            torch.tensor(cu, dtype=torch.int32, device=device), last.to(device),
                            num_decode=decode if decode == len(parts) else 0, max_new=max(len(t) for t in parts))


def test_which_steps_a_graph_can_run():
    model = random_model(torch.float32)
    pool = Pool(model)
    prefill = pool.batch([[1, 2, 3], [4, 5]], [0, 1], "cpu")
    assert not graphable(prefill)
    decode = pool.batch([[6], [7]], [0, 1], "cpu")
    assert graphable(decode)
    scored = ForwardBatch(**{**decode.__dict__, "logits_indices": torch.tensor([0, 1, 1])})   # prompt logprobs
    assert not graphable(scored)


def test_padding_rows_are_masked_whatever_the_previous_step_left():
    inputs = StaticDecodeInputs(max_rows=8, max_pages=4, max_seq_len=32, device=torch.device("cpu"))
    model = random_model(torch.float32)
    pool = Pool(model)
    pool.batch([[1] * 9 for _ in range(6)], list(range(6)), "cpu")
    inputs.load(pool.batch([[2]] * 6, list(range(6)), "cpu"), 8)          # six real rows
    small = pool.batch([[3], [4], [5]], [0, 1, 2], "cpu")
    inputs.load(small, 4)                                                  # then three, in bucket 4
    view = inputs.batch(4)
    assert torch.equal(view.input_ids[:3], small.input_ids) and torch.equal(view.seq_lens[:3], small.seq_lens)
    assert torch.equal(view.page_table[:3, :small.page_table.shape[1]], small.page_table)
    assert view.slot_mapping[3] == -1 and view.seq_lens[3] == 1 and view.page_table[3].eq(0).all()
    assert view.input_ids[3] == 0 and view.positions[3] == 0
    assert view.num_decode == 4 and view.max_new == 1 and view.max_seq_len == 32
    assert view.cu_q.tolist() == [0, 1, 2, 3, 4] and view.logits_indices.tolist() == [0, 1, 2, 3]


def eager_capture(fn):
    """A stand-in for cuda_capture on CPU: 'replay' reruns fn on the static buffers and refills
    the output tensor, as a graph replay does."""
    out = fn().clone()

    def replay():
        out.copy_(fn())
    return replay, out, out.numel() * out.element_size()


def prefilled(model, n, seed=0):
    pool = Pool(model, seed=seed)
    rng = random.Random(seed)
    model.forward(pool.batch([[rng.randrange(97) for _ in range(rng.randrange(1, 20))] for _ in range(n)],
                             list(range(n)), model.device), pool.kv)
    return pool


def test_decode_steps_replay_their_bucket_and_others_run_eagerly():
    model = random_model(torch.float32)
    model.attention_backend = "torch"
    pool = prefilled(model, 5)
    graphs = DecodeGraphs(model, pool.kv, max_batch_size=4, max_seq_len=64, capture=eager_capture)
    assert graphs.buckets == (1, 2, 4)
    k_before = pool.kv.k.clone()
    step = pool.batch([[11], [12], [13]], [0, 1, 2], "cpu")
    out = graphs.forward(step, pool.kv)
    assert graphs.replays == 1 and set(graphs.graphs) == {4} and out.shape == (3, 97)
    # padding wrote nothing: only the three new tokens' slots changed in the cache
    changed = (pool.kv.k != k_before).flatten(1, 2).flatten(2).any(-1).any(0).nonzero().flatten()   # slots
    assert sorted(changed.tolist()) == sorted(step.slot_mapping.tolist())
    # the same step eagerly (its K/V written again, the same values): the same logits
    assert torch.allclose(out, model.forward(step, pool.kv), atol=1e-5)
    graphs.forward(pool.batch([[14], [15]], [3, 4], "cpu"), pool.kv)      # bucket 2, captured now
    assert set(graphs.graphs) == {2, 4} and graphs.replays == 2
    graphs.forward(pool.batch([[1]] * 5, list(range(5)), "cpu"), pool.kv)  # 5 > the largest bucket
    graphs.forward(pool.batch([[1, 2]], [0], "cpu"), pool.kv)              # a prefill chunk
    assert graphs.eager_steps == 2 and graphs.replays == 2


def test_replay_reads_each_steps_inputs_from_the_static_buffers():
    """A replay computes from what `load` copied in: two different steps through one captured
    bucket give each its own eager logits."""
    model = random_model(torch.float32)
    model.attention_backend = "torch"
    pool = prefilled(model, 2, seed=3)
    graphs = DecodeGraphs(model, pool.kv, max_batch_size=2, max_seq_len=64, capture=eager_capture)
    for tokens in ([5, 6], [70, 8]):
        step = pool.batch([[t] for t in tokens], [0, 1], "cpu")
        got = graphs.forward(step, pool.kv).clone()
        assert torch.allclose(got, graphs.eager_padded(step), atol=1e-6)
    assert graphs.replays == 2 and list(graphs.graphs) == [2]


def test_graph_memory_is_bounded_and_logged(caplog):
    model = random_model(torch.float32)
    model.attention_backend = "torch"
    pool = prefilled(model, 4)
    graphs = DecodeGraphs(model, pool.kv, max_batch_size=4, max_seq_len=64, capture=eager_capture,
                          max_graph_bytes=1)      # the first capture already exceeds it
    with caplog.at_level(logging.INFO, logger="pagedecode.model.cuda_graphs"):
        graphs.forward(pool.batch([[1]], [0], "cpu"), pool.kv)
        graphs.forward(pool.batch([[1], [2]], [0, 1], "cpu"), pool.kv)
    assert list(graphs.graphs) == [1] and graphs.eager_buckets == {2} and graphs.eager_steps == 1
    assert graphs.graph_bytes == 97 * 4
    text = caplog.text
    assert "captured the decode graph for batch size 1" in text and "batch size 2 runs eagerly" in text


def test_enforce_eager_and_cpu_keep_the_model_itself():
    model = random_model(torch.float32)
    kv = Pool(model).kv
    assert decode_graphs(model, kv, enforce_eager=False, max_batch_size=8, max_seq_len=64) is model   # CPU
    assert decode_graphs(model, kv, enforce_eager=True, max_batch_size=8, max_seq_len=64) is model
    with pytest.raises(ValueError, match="enforce_eager"):
        pd.EngineConfig(enforce_eager="yes")
    assert pd.EngineConfig(enforce_eager=True).enforce_eager


def test_enforce_eager_flags():
    """generate / demo take --enforce-eager; serve's --enforce-eager comes from EngineConfig's field."""
    import argparse

    from pagedecode.cli import build_parser
    from pagedecode.server.flags import add_arguments, engine_options
    assert build_parser().parse_args(["generate", "--prompt", "x", "--enforce-eager"]).enforce_eager
    assert not build_parser().parse_args(["generate", "--prompt", "x"]).enforce_eager
    serve = argparse.ArgumentParser()
    add_arguments(serve)
    assert engine_options(serve.parse_args(["--enforce-eager"]))["enforce_eager"] is True


ON_GPU = torch.cuda.is_available() and HAS_TRITON and not interpreting()


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA and compiled Triton")
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_graph_replay_gives_the_eager_bits_on_cuda(dtype, deterministic):
    model = random_model(dtype, heads=8, kv_heads=2, head_dim=64, device="cuda", max_pos=512)
    model.deterministic = deterministic
    pool = prefilled(model, 6, seed=1)
    graphs = decode_graphs(model, pool.kv, enforce_eager=False, max_batch_size=8, max_seq_len=512)
    assert isinstance(graphs, DecodeGraphs)
    for step_tokens in ([3, 4, 5], [9, 8, 7], [1, 2, 3, 4, 5, 6]):
        seqs = list(range(len(step_tokens)))
        step = pool.batch([[t] for t in step_tokens], seqs, "cuda")
        eager = graphs.eager_padded(step).clone()        # the padded step, kernel for kernel
        got = graphs.forward(step, pool.kv).clone()
        assert torch.equal(got, eager)
        if deterministic:       # batch-invariant kernels: the unpadded eager step too
            assert torch.equal(got, model.forward(step, pool.kv))
    assert graphs.replays == 3 and set(graphs.graphs) == {4, 8}
