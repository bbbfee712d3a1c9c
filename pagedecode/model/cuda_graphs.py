"""CUDA graphs for decode steps: a small model's decode step on a GPU is mostly kernel launches
(SmolLM2-135M: 30 layers x ~10 kernels), so each step is captured once per batch-size bucket and
replayed, the host then launching one graph instead of hundreds of kernels.

How it fits around the model (which it does not change):
    DecodeGraphs(model, kv, ...) is itself a pd.Model. forward(batch) of a pure decode batch
    (one new token and one logits row per sequence) of n <= the largest bucket sequences:
        bucket = the smallest bucket >= n
        copy the batch into the bucket's static input buffers; rows n..bucket-1 are padding:
            slot -1 (their K/V are never written), length 1 over page 0 (read, never trusted)
        replay the bucket's graph (captured on first use), return its logits[:n]
    anything else (prefill chunks, prompt logprobs, drafts, a larger batch): model.forward, eager.

Every bucket shares the static buffers (bucket b uses their first b rows) and one memory pool;
captures stop once the graphs hold more than max_graph_bytes, the rest of the buckets running
eagerly (logged). The decode attention of a captured step sizes its splits for `max_seq_len`
(the engine's context bound: ForwardBatch.max_seq_len), so replay never reads a length back to
the host; eager steps read the batch's own longest length. The graph runs the same kernels
with the same launch parameters as an eager forward of the padded batch, so the two agree bit
for bit (tests/model/test_cuda_graphs.py, on a GPU).

The logits returned by a replay are a view of the graph's output: valid until the next forward.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Callable, Protocol

import torch

from ..protocols import Model
from .batch import ForwardBatch
from .kv_cache import KVCache

log = logging.getLogger(__name__)

DEFAULT_MAX_GRAPH_BYTES = 1 << 30     # memory the captured graphs may hold (their pool), all buckets


def decode_buckets(max_batch_size: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to max_batch_size, which is a bucket itself when not a power of two."""
    sizes, b = [], 1
    while b < max_batch_size:
        sizes.append(b)
        b *= 2
    return tuple(sizes + [max_batch_size])


def bucket_for(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding n rows; None when n exceeds them all (the step runs eagerly)."""
    for b in buckets:
        if b >= n:
            return b
    return None


def graphable(batch: ForwardBatch) -> bool:
    """A step a decode graph can run: every sequence adds one token and wants its logits row,
    row i for sequence i (no prefill chunk, prompt logprobs or draft verification), and no LoRA
    adapter (its segments change from step to step)."""
    n = batch.num_seqs
    return batch.lora is None and n > 0 and batch.num_decode == n and batch.num_tokens == n and batch.logits_indices.shape[0] == n


class StaticDecodeInputs:
    """The input buffers every captured graph reads, sized for the largest bucket; `load` copies
    a batch into their first rows and masks the padding rows up to its bucket."""

    def __init__(self, max_rows: int, max_pages: int, max_seq_len: int, device: torch.device) -> None:
        i64 = torch.int64
        self.input_ids = torch.zeros(max_rows, dtype=i64, device=device)
        self.positions = torch.zeros(max_rows, dtype=i64, device=device)
        self.slot_mapping = torch.full((max_rows,), -1, dtype=i64, device=device)
        self.page_table = torch.zeros(max_rows, max_pages, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(max_rows, dtype=torch.int32, device=device)
        self.rows = torch.arange(max_rows, dtype=i64, device=device)               # logits_indices: row i is sequence i's
        self.cu_q = torch.arange(max_rows + 1, dtype=torch.int32, device=device)   # one token per sequence
        self.max_pages = max_pages
        self.max_seq_len = max_seq_len

    def batch(self, bucket: int) -> ForwardBatch:
        """The bucket's view of the buffers, as the graph sees it (captured once per bucket)."""
        return ForwardBatch(
            input_ids=self.input_ids[:bucket], positions=self.positions[:bucket],
            slot_mapping=self.slot_mapping[:bucket], page_table=self.page_table[:bucket],
            seq_lens=self.seq_lens[:bucket], cu_q=self.cu_q[:bucket + 1],
            logits_indices=self.rows[:bucket], num_decode=bucket, max_new=1, max_seq_len=self.max_seq_len)

    def load(self, batch: ForwardBatch, bucket: int) -> None:
        """Copy batch's n rows in; rows n..bucket-1 become padding: no K/V write (slot -1), a
        context of one token on page 0 (any page exists; what it holds is never returned)."""
        n, cols = batch.num_seqs, batch.page_table.shape[1]
        assert graphable(batch) and n <= bucket and cols <= self.max_pages
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(batch.slot_mapping, non_blocking=True)
        self.page_table[:n, :cols].copy_(batch.page_table, non_blocking=True)  # later columns: never read
        self.seq_lens[:n].copy_(batch.seq_lens, non_blocking=True)
        if n < bucket:
            self.input_ids[n:bucket].zero_()
            self.positions[n:bucket].zero_()
            self.slot_mapping[n:bucket].fill_(-1)
            self.page_table[n:bucket].zero_()
            self.seq_lens[n:bucket].fill_(1)


class Replay(Protocol):
    def __call__(self) -> None: ...


Capture = Callable[[Callable[[], torch.Tensor]], "tuple[Replay, torch.Tensor, int]"]


def cuda_capture(pool: Any) -> Capture:
    """Capture fn into a CUDA graph in `pool` after two warm-up runs on a side stream (they compile
    the Triton kernels and settle the allocator). Returns (replay, the output tensor the replay
    refills, bytes the capture added to what the allocator holds: the pool's new segments)."""
    def capture(fn: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor, int]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        torch.cuda.synchronize()
        return graph.replay, out, torch.cuda.memory_reserved() - before
    return capture


@dataclass
class _Captured:
    replay: Replay
    logits: torch.Tensor       # (bucket, vocab): what replay refills


class DecodeGraphs:
    """A pd.Model running pure decode steps as CUDA graphs per batch-size bucket (module
    docstring). capture: how a bucket's step becomes a replayable graph (cuda_capture on a GPU;
    tests pass one that replays eagerly)."""

    def __init__(self, model: Model, kv: KVCache, max_batch_size: int, max_seq_len: int,
                 max_graph_bytes: int = DEFAULT_MAX_GRAPH_BYTES, capture: Capture | None = None) -> None:
        self.model = model
        self.device: torch.device = model.device      # a pd.Model, as the wrapped one
        self.dtype: torch.dtype = model.dtype
        self.kv = kv
        self.buckets = decode_buckets(max_batch_size)
        max_pages = -(-max_seq_len // kv.page_size)
        self.inputs = StaticDecodeInputs(self.buckets[-1], max_pages, max_seq_len, model.device)
        self.max_graph_bytes = max_graph_bytes
        self.graph_bytes = 0
        self.graphs: dict[int, _Captured] = {}
        self.eager_buckets: set[int] = set()      # over the memory bound: never captured
        if capture is None:
            capture = cuda_capture(torch.cuda.graph_pool_handle())
        self._capture = capture
        self.replays = 0
        self.eager_steps = 0

    @property
    def config(self):
        return self.model.config

    def __getattr__(self, name: str):
        # everything else (deterministic, attention_backend, weight_bytes, ...) is the model's
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)

    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        bucket = bucket_for(batch.num_seqs, self.buckets) if graphable(batch) else None
        if (bucket is None or kv is not self.kv or batch.page_table.shape[1] > self.inputs.max_pages
                or bucket in self.eager_buckets):
            self.eager_steps += 1
            return self.model.forward(batch, kv)
        graph = self.graphs.get(bucket) or self._capture_bucket(bucket)
        if graph is None:
            self.eager_steps += 1
            return self.model.forward(batch, kv)
        self.inputs.load(batch, bucket)
        graph.replay()
        self.replays += 1
        return graph.logits[:batch.num_seqs]

    def eager_padded(self, batch: ForwardBatch) -> torch.Tensor:
        """The eager forward of exactly what a replay computes (batch padded to its bucket, splits
        sized for max_seq_len): the graph must give these bits. For tests and the device check."""
        bucket = bucket_for(batch.num_seqs, self.buckets)
        assert bucket is not None
        self.inputs.load(batch, bucket)
        padded = self.inputs.batch(bucket)
        copy = replace(padded, **{f: getattr(padded, f).clone() for f in (
            "input_ids", "positions", "slot_mapping", "page_table", "seq_lens", "cu_q", "logits_indices")})
        return self.model.forward(copy, self.kv)[:batch.num_seqs]

    def _capture_bucket(self, bucket: int) -> _Captured | None:
        if self.graph_bytes >= self.max_graph_bytes:
            log.warning("decode graphs hold %d MiB (bound %d MiB): batch size %d runs eagerly",
                        self.graph_bytes >> 20, self.max_graph_bytes >> 20, bucket)
            self.eager_buckets.add(bucket)
            return None
        padded = self.inputs.batch(bucket)        # all rows padding while capturing: the cache is not written
        self.inputs.slot_mapping[:bucket].fill_(-1)
        self.inputs.seq_lens[:bucket].fill_(1)
        replay, logits, added = self._capture(lambda: self.model.forward(padded, self.kv))
        self.graph_bytes += max(0, added)
        self.graphs[bucket] = _Captured(replay, logits)
        log.info("captured the decode graph for batch size %d: +%d KiB, graphs hold %d MiB of %d MiB",
                 bucket, max(0, added) >> 10, self.graph_bytes >> 20, self.max_graph_bytes >> 20)
        return self.graphs[bucket]


def decode_graphs(model: Model, kv: KVCache, enforce_eager: bool, max_batch_size: int,
                  max_seq_len: int) -> Model:
    """The model the engine steps: DecodeGraphs around it on a CUDA device, unless enforce_eager;
    the model itself on CPU, with enforce_eager, or for a model the graphs cannot hold (a
    tensor-parallel model's ranks run in other processes)."""
    if enforce_eager or model.device.type != "cuda" or int(getattr(model, "world", 1)) > 1:
        return model
    return DecodeGraphs(model, kv, max_batch_size, max_seq_len)
