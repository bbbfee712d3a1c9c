"""Tensor parallelism over torch.distributed: one engine, N ranks, the same tokens.

What each rank holds and computes (Megatron-style shards read at load time) is model/shard.py's.

One control plane: the engine (scheduler, page table, sampler, detokenizer, every request)
lives on rank 0. Each step rank 0 broadcasts a fixed-size header tensor and the batch's index
tensors; the workers run the same forward over their shards. Ranks are started by the engine
(`Engine.from_pretrained(path, tensor_parallel_size=N)`: torch.multiprocessing spawn, a free
loopback port; NCCL on CUDA with one GPU per rank, gloo on CPU). Under torchrun, rank 0 builds
the engine with `TensorParallelModel(path, N, joined=True)` and the other ranks call
`pagedecode.model.parallel.serve_rank(path)`; the user writes no distributed code either way.

Failure: a worker that dies or raises makes rank 0's collective fail (or time out after
`timeout_s`); that step's requests fail with model_error, the group is shut down, and the
model refuses every later step with ModelUnavailableError.
"""
from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import signal
import socket
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ..errors import ModelUnavailableError
from .batch import ForwardBatch
from .kv_cache import KVCache
from .shard import ShardedLlama, check_divisible, load_shard

OP_FORWARD, OP_STOP = 1, 2
STOP_WAIT_S = 2.0     # a worker told to stop leaves its group and exits in well under this
HEADER = 10      # op, T, S, max_pages, n_logits, num_decode, max_new, num_pages, page_size, deterministic


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """SIGINT held until the block ends, when it runs on the main thread (`pagedecode generate`):
    a KeyboardInterrupt between two collectives would leave the workers waiting in the next one
    (60 s, then a gloo error) and the group unable to stop. The interrupt is raised right after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda sig, frame: caught.append(sig))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            signal.raise_signal(signal.SIGINT)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _send_batch(batch: ForwardBatch, kv: KVCache, deterministic: bool) -> None:
    header = torch.tensor([OP_FORWARD, batch.num_tokens, batch.num_seqs, batch.page_table.shape[1],
                           batch.logits_indices.shape[0], batch.num_decode, batch.max_new, kv.num_pages,
                           kv.page_size, int(deterministic)], dtype=torch.int64)
    dist.broadcast(header, src=0)
    for t in (batch.input_ids, batch.positions, batch.slot_mapping, batch.logits_indices):
        dist.broadcast(t.to(torch.int64).contiguous(), src=0)
    for t in (batch.page_table, batch.seq_lens, batch.cu_q):
        dist.broadcast(t.to(torch.int64).contiguous(), src=0)


def _recv_batch(header: torch.Tensor, device: torch.device) -> ForwardBatch:
    _, T, S, P, N, nd, max_new = (int(x) for x in header[:7])
    ids, pos, slots, logits_idx = (torch.empty(k, dtype=torch.int64) for k in (T, T, T, N))
    table, lens, cu = torch.empty(S, P, dtype=torch.int64), torch.empty(S, dtype=torch.int64), \
        torch.empty(S + 1, dtype=torch.int64)
    for t in (ids, pos, slots, logits_idx, table, lens, cu):
        dist.broadcast(t, src=0)
    return ForwardBatch(ids.to(device), pos.to(device), slots.to(device), table.to(torch.int32).to(device),
                        lens.to(torch.int32).to(device), cu.to(torch.int32).to(device), logits_idx.to(device),
                        num_decode=nd, max_new=max_new)


def _init_group(rank: int, world: int, port: int, device: torch.device, timeout_s: float) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


def _load(path: Path, rank: int, world: int, device: torch.device, dtype: Any, backend: str) -> ShardedLlama:
    from .loader import load_config, resolve_dtype
    config = load_config(path)
    check_divisible(config, world)
    torch_dtype = resolve_dtype(dtype, config, device)
    weights = load_shard(path, config, rank, world)
    if "lm_head.weight" not in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]       # tied: the same vocab slice
    return ShardedLlama(config, rank, world, weights, device, torch_dtype, backend)


def _worker(path: str, rank: int, world: int, port: int, device: str, dtype: Any, backend: str,
            timeout_s: float) -> None:
    # Rank 0 owns the group's life: a Ctrl-C (sent to the whole process group) or a SIGTERM to
    # every process must not stop a worker halfway through a collective; rank 0 finishes its
    # step and sends OP_STOP.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    dev = torch.device(device if device == "cpu" else f"cuda:{rank}")
    torch.set_num_threads(1)
    try:
        _init_group(rank, world, port, dev, timeout_s)
        serve_rank(Path(path), rank=rank, world=world, device=dev, dtype=dtype, attention_backend=backend)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)             # told to stop: the interpreter's teardown (~1 s with torch) does nothing for us
    except Exception:
        parent = multiprocessing.parent_process()
        if parent is not None and not parent.is_alive():
            os._exit(1)         # rank 0 is gone (killed): nobody to report to, nothing to clean
        raise


def serve_rank(path: str | Path, rank: int | None = None, world: int | None = None, device: torch.device | None = None,
               dtype: Any = None, attention_backend: str = "auto") -> None:
    """A worker rank's loop (also what torchrun's ranks > 0 call, after init_process_group)."""
    rank = dist.get_rank() if rank is None else rank
    world = dist.get_world_size() if world is None else world
    dev = device or torch.device("cpu")
    model = _load(Path(path), rank, world, dev, dtype, attention_backend)
    kv: KVCache | None = None
    c = model.config
    try:
        while True:
            header = torch.empty(HEADER, dtype=torch.int64)
            dist.broadcast(header, src=0)
            if int(header[0]) == OP_STOP:
                break
            batch = _recv_batch(header, dev)
            model.deterministic = bool(header[9])          # EngineConfig.deterministic, as rank 0 runs
            num_pages, page_size = int(header[7]), int(header[8])
            if kv is None or kv.num_pages != num_pages or kv.page_size != page_size:
                kv = KVCache(c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim, model.dtype, dev)
            model.forward(batch, kv)
    finally:
        dist.destroy_process_group()


def load_tensor_parallel(path: str | Path, n: int, device: str = "cpu", dtype: Any = None,
                         attention_backend: str = "auto", joined: bool = False) -> tuple[Any, Any]:
    """(rank 0's TensorParallelModel, the tokenizer), as load_model gives them at N = 1."""
    from .loader import load_config
    from .tokenizer import Tokenizer
    mc = load_config(Path(path))
    tokenizer = Tokenizer.from_dir(path, eos_token_ids=mc.eos_token_ids, bos_token_id=mc.bos_token_id)
    tp = TensorParallelModel(path, n, device=device, dtype=dtype, attention_backend=attention_backend, joined=joined)
    if not tp.config.eos_token_ids:
        tp.config.eos_token_ids = tokenizer.eos_token_ids
    return tp, tokenizer


class TensorParallelModel:
    """Rank 0's view of an N-rank model: a pd.Model whose forward drives every rank."""

    def __init__(self, path: str | Path, tensor_parallel_size: int, device: str = "cpu", dtype: Any = None,
                 attention_backend: str = "auto", timeout_s: float = 60.0, joined: bool = False) -> None:
        import torch.multiprocessing as mp
        from .loader import load_config
        self.path = Path(path)
        n = self.world = tensor_parallel_size
        config = load_config(self.path)
        check_divisible(config, n)          # before any process starts
        self.device = torch.device(device if device == "cpu" else "cuda:0")
        self.failure: str | None = None
        self._procs: list[Any] = []
        if not joined:
            if dist.is_initialized():
                raise RuntimeError("a tensor-parallel engine is already running in this process (torch.distributed "
                                   "has one default group): close() it first")
            port = _free_port()
            ctx = mp.get_context("spawn")
            for rank in range(1, n):
                p = ctx.Process(target=_worker, args=(str(path), rank, n, port, device, dtype, attention_backend,
                                                      timeout_s), daemon=True, name=f"pagedecode-tp{rank}")
                p.start()
                self._procs.append(p)
            atexit.register(self.close)
            _init_group(0, n, port, self.device, timeout_s)
        self.shard = _load(self.path, 0, n, self.device, dtype, attention_backend)
        self.config = self.shard.config            # per-rank shapes: the engine's KV cache is rank 0's
        self.full_config = config
        self.dtype = self.shard.dtype
        self.attention_backend = attention_backend
        self.deterministic = False          # EngineConfig.deterministic; sent to every rank with each step

    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        if self.failure is not None:
            raise ModelUnavailableError(self.failure)
        dead = [p.name for p in self._procs if not p.is_alive()]
        if dead:
            self._fail(f"tensor-parallel rank process {', '.join(dead)} died")
        try:
            with _interrupts_held():
                _send_batch(batch, kv, self.deterministic)
                self.shard.deterministic = self.deterministic
                return self.shard.forward(batch, kv)
        except ModelUnavailableError:
            raise
        except Exception as e:
            self._fail(f"tensor-parallel step failed: {type(e).__name__}: {e}")
            raise AssertionError("unreachable")

    def _fail(self, why: str) -> None:
        self.failure = why
        self._stop_processes()
        raise ModelUnavailableError(why)

    def _stop_processes(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
        self._procs = []
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass

    def close(self) -> None:
        """Stop every worker and leave the group (idempotent; also at interpreter exit)."""
        if self.failure is None and dist.is_initialized():
            try:
                dist.broadcast(torch.tensor([OP_STOP] + [0] * (HEADER - 1), dtype=torch.int64), src=0)
            except Exception:
                pass
            for p in self._procs:
                p.join(timeout=STOP_WAIT_S)         # then killed
        if self.failure is None:
            self.failure = "the tensor-parallel group was closed"
        self._stop_processes()
