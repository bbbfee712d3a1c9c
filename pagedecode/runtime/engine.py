"""The synchronous engine: requests in, ordered events out, one safe point per step.

The engine is built from parts that each own their state, given what they need in their
constructors: the scheduler (pages and slots), Intake (checks, a Request), Delivery (history,
cursors, backpressure, results), Endings (cancels, the safe point's checks, every way a request
ends), StepRunner (batch, forward, selection: runner.py), Commit (a selection becomes tokens:
commit.py), the grammar side and the token selector. engine.py keeps their construction and step().

A step is a transaction: schedule (under the lock), then run the model and choose tokens without
touching any request (StepRunner), then commit under the lock. An exception before the commit
fails that step's requests (model_error) and nothing of the step is kept; an exception while
committing one request fails that request only. Cancels and deadlines take effect at the safe
points around it.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..model.cuda_graphs import decode_graphs
from ..model.kv_cache import KVCache
from ..lora.adapter import LoRAAdapter
from ..lora.manager import LoRAManager
from ..lora.request import LoRARequest
from ..model.tokenizer import TokenizerLike, as_tokenizer
from ..params import SamplingParams
from ..protocols import Model, ModelParts
from .config import EngineConfig
from .admission import Admission
from .commit import Commit
from .output.delivery import Attachment, Delivery, output
from .endings import Endings
from .output.events import Event
from .grammar import Constraints
from .grammar_compiler import CompileJob
from .intake import Intake
from .loading import configure, from_pretrained
from .lifecycle import RequestState
from .page_pool import CacheEvent, PagePool
from .process import ProcessEffects
from .registry import RequestRegistry
from .request import Request
from .output.result import RequestOutput
from .runner import StepRunner
from .scheduler import Scheduler
from .selector import TokenSelector
from .slots import SlotTable
from .snapshot import EngineSnapshot, take_snapshot
from .spec import Speculator
from .trace import now_us


class Engine:
    def __init__(self, model: Model, tokenizer: TokenizerLike | Any, config: EngineConfig | None = None) -> None:
        if not isinstance(model, Model):
            raise TypeError(f"model must be a pd.Model (config, device, dtype, forward), got {type(model).__name__}")
        self.model = model
        self.tokenizer: TokenizerLike = as_tokenizer(tokenizer)
        self.config = config = config or EngineConfig()
        kv_dtype = config.kv_dtype(model.dtype)       # checked before anything is set on the model
        if kv_dtype != model.dtype and model.dtype != torch.float32:
            raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype!r} needs a float32 model: this one computes in "
                             f"{model.dtype}, and its KV cache is that dtype; use kv_cache_dtype='auto'")
        if kv_dtype != model.dtype and ModelParts(model).world > 1:
            raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype!r}: a tensor-parallel model's KV cache is "
                             f"its own dtype ({model.dtype}); use kv_cache_dtype='auto'")
        configure(model, config)
        self.process = ProcessEffects()          # what this engine changes for the process; restored by shutdown()
        # a tensor-parallel model's other ranks run one thread each (model/parallel.py): by default
        # this rank takes the rest of the cores, so that no more workers spin than there are cores
        world = int(getattr(model, "world", 1))
        self.num_threads = config.num_threads or max(1, config.threads() - (world - 1))
        self.process.set_threads(self.num_threads)
        # glibc's malloc setting when the model runs the compiled forward: by the engine, never by a
        # model's constructor
        if config.cpu_keep_freed_memory and ModelParts(model).uses_cpu_extension():
            self.process.keep_freed_memory()
        mc = model.config
        self.device = torch.device(getattr(model, "device", "cpu"))
        self.bytes_per_token = KVCache.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, kv_dtype)
        model_ctx = min(mc.max_context, config.max_context or mc.max_context)
        num_pages = config.kv_pages(self.bytes_per_token, model_ctx)
        self.kv = KVCache(mc.num_layers, num_pages, config.page_size, mc.num_kv_heads, mc.head_dim,
                          kv_dtype, self.device)
        self.pool = PagePool(num_pages)
        self.slots = SlotTable(config.max_batch_size)
        self.lora = LoRAManager(model, config.max_loras, config.max_lora_rank)    # adapters (lora/manager.py)
        self.scheduler = Scheduler(self.pool, self.slots, config.page_size, config.max_tokens_per_step,
                                   prefix_caching=config.enable_prefix_caching, adapters=self.lora.residency)
        # a sequence never holds more than the pool: that bounds the context too
        self.max_context = min(model_ctx, num_pages * config.page_size)
        self.vocab_size = mc.vocab_size
        self.eos_ids = frozenset(mc.eos_token_ids or self.tokenizer.eos_token_ids)
        self.model_name = config.model_name or getattr(mc, "name", None) or mc.model_type
        self.constraints = Constraints.from_config(self.tokenizer, self.vocab_size, self.eos_ids, self.device, config,
                                                    self.max_context)
        # always there: without config.speculative it drafts only for requests with a prediction
        self.speculator = Speculator(config.speculative, self.max_context, config.page_size, model,
                                     num_pages * config.page_size, config.deterministic, kv_dtype, self.kv)
        identity = f"{self.model_name}|{mc.model_type}|{mc.vocab_size}|{mc.num_layers}|{model.dtype}|{id(model)}"
        self.intake = Intake(self.tokenizer, self.vocab_size, self.max_context, self.constraints, config.seed,
                             config.trace, identity)
        self.selector = TokenSelector(self.eos_ids, config.max_batch_size, self.vocab_size, self.device,
                                      config.sampling_backend)
        self.wakeup: Callable[[], None] | None = None    # the async loop's "there is work" hook
        self.requests = RequestRegistry(config.max_finished_kept, config.max_finished_bytes, config.request_id_prefix)
        self._lock = threading.RLock()
        self.delivery = Delivery(self.requests, self._lock, config, self._wake)
        self.endings = Endings(self.scheduler, self.requests, self.delivery, config, self._lock, self._wake)
        self.admission = Admission(self.intake, self.requests, self.delivery, self.scheduler, model,
                                   self.model_name, config.deterministic, self._lock, self._wake, self.lora)
        # on CUDA, pure decode steps replay a CUDA graph per batch-size bucket (unless enforce_eager)
        stepped = decode_graphs(model, self.kv, config.enforce_eager, config.max_batch_size, self.max_context)
        self.runner = StepRunner(stepped, self.kv, self.selector, self.constraints, config.page_size, self.device,
                                 self.lora)
        self.commit = Commit(self.scheduler, self.endings, self.delivery, self.constraints, self.selector,
                             self.runner.select, self.eos_ids, self.max_context)
        # the consumer's side, answered by the parts that own it (thread-safe; see their docstrings)
        d = self.delivery
        self.replay, self.newest_event, self.ack, self.read_events = d.replay, d.newest_event, d.ack, d.read_events
        self.result, self.trace, self.detach_stream = d.result, d.trace, d.detach
        self.pin, self.unpin, self.forget = d.pin, d.unpin, d.forget
        self.cancel, self.cancel_all = self.endings.cancel, self.endings.cancel_all
        self.warm_grammar = self.constraints.compiler.warm   # start the grammar backend before the first use
        self.steps = 0                      # steps that ran the model (one that found nothing to run is not one)
        self.step_records: deque[dict[str, Any]] = deque(maxlen=4096 if config.trace != "off" else 0)
        # perf_counter microseconds + wall_offset_us = wall-clock microseconds (traces line up with logs)
        self.wall_offset_us = time.time() * 1e6 - now_us()

    @classmethod
    def from_pretrained(cls, path: str | Path, *args: Any, **options: Any) -> "Engine":
        """An engine over a checkpoint: runtime/loading.py (device, dtype, tensor_parallel_size,
        quantization, tokenizer, then EngineConfig's options)."""
        return from_pretrained(cls, path, *args, **options)

    @property
    def tensor_parallel_size(self) -> int:
        return ModelParts(self.model).world

    @property
    def weight_bytes(self) -> int:
        """Bytes the model's weights take in memory (this rank's), as its forward holds them:
        quantized blocks at their size. 0 for a model that does not say (`weight_bytes`)."""
        return ModelParts(self.model).weight_bytes

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The KV cache's element type (EngineConfig.kv_cache_dtype resolved against the model's)."""
        return self.kv.k.dtype

    @property
    def bytes_per_token_total(self) -> int:
        """KV bytes per token over every rank (bytes_per_token is this rank's)."""
        return self.bytes_per_token * self.tensor_parallel_size

    def shutdown(self) -> list[Event]:
        """Stop everything: end every live request (cancelled, each exactly once), then stop the
        model's worker processes, if it has any, and put back what the engine changed for the process
        (idempotent). Returns the requests' last events.
        To end the requests and keep the engine serving, use end_all()."""
        events = self.end_all()
        self.constraints.compiler.shutdown()
        ModelParts(self.model).close()
        self.process.restore()
        return events

    def close(self) -> None:
        """The same as shutdown()."""
        self.shutdown()

    # -- requests in ------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, acked: bool = False,
                    attachment: Attachment | None = None, pinned: bool = False,
                    lora: LoRARequest | None = None) -> str:
        """Queue a request; returns its id, or raises InvalidRequestError (nothing queued). Its
        events go to its history; acked=True gives it an ack cursor (backpressure: delivery.py).
        `attachment` (anything with `kept_bytes()`, such as the server's Track) is kept as long as
        the request is, and counted; pinned=True pins it from the moment it exists (see `pin`).
        lora: the LoRA adapter it runs under (loaded on first use; a bad one: AdapterError)."""
        return self.admission.add(prompt, params, request_id, acked, attachment, pinned, lora).request_id

    def prepare_grammar(self, params: SamplingParams | None) -> CompileJob | None:
        """Start a constrained request's parse and compile in the grammar worker (cheap, any
        thread; over the schema limits: InvalidRequestError). A server awaits `job.parsed` off its
        event loop first, so `add_request` does not wait for it."""
        return self.intake.prepare_grammar(params)

    def generate(self, prompts: Any, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Run the prompts to completion; outputs in the order given. All requests are checked
        before any is queued, so a bad one raises and queues nothing. lora: one adapter for
        every prompt, or one (or None) per prompt."""
        reqs = self.admission.add_all(prompts, params, lora)
        while any(not r.state.terminal for r in reqs):
            self.step()
        return [output(r) for r in reqs]

    # -- LoRA adapters (lora/) ----------------------------------------------------------------------
    def load_lora(self, lora: LoRARequest) -> LoRAAdapter:
        """Read and check an adapter now (rather than at its first request); AdapterError if bad."""
        return self.lora.load(lora.name, lora.path)

    def unload_lora(self, name: str) -> None:
        """Forget an adapter (UnknownAdapterError if not loaded); its running requests finish under it."""
        adapter = self.lora.unload(name)
        with self._lock:
            self.lora.residency.forget(adapter.key)

    def lora_adapters(self) -> list[LoRAAdapter]:
        """The adapters loaded, by name."""
        return self.lora.adapters()

    def has_unfinished(self) -> bool:
        return bool(self.requests.live)

    def snapshot(self) -> EngineSnapshot:
        """The engine's requests, pages, slots and counters at this moment (thread-safe, cheap)."""
        with self._lock:
            return take_snapshot(self.scheduler, self.requests.num_finished, self.steps,
                                 self.admission.prompt_tokens, self.commit.generated_tokens,
                                 self.speculator.counters)

    def check_integrity(self) -> None:
        """The pool's invariants, plus: no step wrote a shared or cached page."""
        self.scheduler.check_integrity()

    def _wake(self) -> None:
        if self.wakeup is not None:
            self.wakeup()

    def end_all(self) -> list[Event]:
        """End every live request (cancelled) now, each exactly once, and keep serving; returns
        the events (cancel_all() only asks, for the step loop's next safe point)."""
        with self._lock:
            events = self.admission.take_outbox()
            self.endings.cancel_all()
            self.endings.safe_point(events)
        return events

    # -- the step ---------------------------------------------------------------------------------
    def step(self) -> list[Event]:
        """Schedule, run the model and choose tokens, then at the safe point commit them, apply
        cancels and deadlines and emit events. Returns this step's events in order."""
        t0 = now_us()
        with self._lock:
            events = self.admission.take_outbox()
            self.endings.safe_point(events)
            plan = self.scheduler.schedule(self._runnable)
            if plan.empty:
                self.pool.flush_events()
                return events
            self.speculator.extend(plan, self.scheduler, self.config.max_tokens_per_step - plan.num_tokens)
            plan.begin(time.perf_counter())
        try:
            selection, failure = self.runner.run(plan), None
        except Exception as exc:       # a device or sampler fault fails this step's requests, not the engine
            selection, failure = None, exc
        with self._lock:
            if selection is not None:
                runs = self.commit.seqs(plan, selection, (now_us() - t0) / 1e6, events)
                if runs:        # verify seqs: the speculator takes their tokens through the commit
                    assert selection.drafts is not None
                    self.speculator.verify(plan.verify, runs, selection, selection.drafts, self.commit, events)
            else:
                self.endings.fail_step(plan, failure, events)
            self.endings.safe_point(events)
            self.steps += 1
            self.step_records.append({"step": self.steps, "t_us": t0, "dur_us": now_us() - t0,
                                      "decode": len(plan.decode), "prefill": len(plan.prefill),
                                      "verify": len(plan.verify)})
            self.pool.flush_events()
        return events

    def publish_cache_events(self, sink: Callable[[list[CacheEvent]], None] | None) -> None:
        """Hand the prefix cache's changes (page_pool.py's log: pages hashed, hashes dropped) to
        sink once per step that changed it, in order, from the step's thread under the engine
        lock (sink must be quick: pagedecode/kv_events.py queues them for its own thread).
        None stops it."""
        with self._lock:
            self.pool.publish(sink)

    def _runnable(self, req: Request) -> bool:
        """Not scheduled: a request being cancelled, held back by its consumer (backpressure), or
        waiting for its grammar's compile."""
        if req.grammar is not None and not self.constraints.ready(req.grammar):
            return False
        return req.state != RequestState.CANCEL_REQUESTED and not self.delivery.held_back(req)
