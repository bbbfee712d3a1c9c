"""The synchronous engine: requests in, ordered events out, one safe point per step.

The engine is built from parts that each own their state: the scheduler (pages and slots),
Intake (checks, a Request), Delivery (history, cursors, backpressure, results: delivery.py),
Endings (cancels, the safe point's checks, every way a request ends: endings.py), the grammar
side (grammar.py) and the token selector. engine.py keeps their construction, step() and the
commit.

A step is a transaction: schedule (under the lock), then build the batch, run the model and
choose tokens without touching any request, then commit under the lock. An exception before
the commit fails that step's requests (model_error) and nothing of the step is kept; an
exception while committing one request fails that request only. Cancels and deadlines take
effect at the safe points around it.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..model.kv_cache import KVCache
from ..model.tokenizer import TokenizerLike, as_tokenizer
from ..params import SamplingParams
from ..protocols import Model
from .batching import build_batch
from .config import EngineConfig
from .delivery import Attachment, Delivery, output
from .endings import Endings
from .events import Event
from .finish_rules import check_ending, is_eos, nothing_allowed
from .grammar import CompileJob, Constraints
from .intake import Intake, paired
from .loading import configure, from_pretrained
from .lifecycle import FinishReason, RequestState
from .page_pool import CacheEvent, PagePool
from .registry import RequestRegistry
from .request import Request
from .result import RequestOutput
from .scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from .selector import SampleRows, Selection, TokenSelector, TopLogprobs, prompt_logprobs
from .slots import SlotTable
from .snapshot import EngineSnapshot, take_snapshot
from .speculative import Speculator
from .trace import now_us



class Engine:
    def __init__(self, model: Model, tokenizer: TokenizerLike | Any, config: EngineConfig | None = None) -> None:
        if not isinstance(model, Model):
            raise TypeError(f"model must be a pd.Model (config, device, dtype, forward), got {type(model).__name__}")
        self.model = model
        self.tokenizer: TokenizerLike = as_tokenizer(tokenizer)
        self.config = config = config or EngineConfig()
        configure(model, config)
        mc = model.config
        self.device = torch.device(getattr(model, "device", "cpu"))
        self.bytes_per_token = KVCache.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, model.dtype)
        model_ctx = min(mc.max_context, config.max_context or mc.max_context)
        num_pages = config.kv_pages(self.bytes_per_token, model_ctx)
        self.kv = KVCache(mc.num_layers, num_pages, config.page_size, mc.num_kv_heads, mc.head_dim,
                          model.dtype, self.device)
        self.pool = PagePool(num_pages)
        self.slots = SlotTable(config.max_batch_size)
        self.scheduler = Scheduler(self.pool, self.slots, config.page_size, config.max_tokens_per_step,
                                   prefix_caching=config.enable_prefix_caching)
        # a sequence never holds more than the pool: that bounds the context too
        self.max_context = min(model_ctx, num_pages * config.page_size)
        self.vocab_size = mc.vocab_size
        self.eos_ids = frozenset(mc.eos_token_ids or self.tokenizer.eos_token_ids)
        self.model_name = config.model_name or getattr(mc, "name", None) or mc.model_type
        self.constraints = Constraints.from_config(self.tokenizer, self.vocab_size, self.eos_ids, self.device, config)
        self.speculator = (None if config.speculative is None else
                           Speculator(config.speculative, self.max_context, config.page_size, model,
                                      num_pages * config.page_size))
        identity = f"{self.model_name}|{mc.model_type}|{mc.vocab_size}|{mc.num_layers}|{model.dtype}|{id(model)}"
        self.intake = Intake(self.tokenizer, self.vocab_size, self.max_context, self.constraints, config.seed,
                             config.trace, identity)
        self.selector = TokenSelector(self.eos_ids, config.max_batch_size, self.vocab_size, self.device,
                                      config.sampling_backend)
        self.wakeup: Callable[[], None] | None = None    # the async loop's "there is work" hook
        self._cache_sink: Callable[[list[CacheEvent]], None] | None = None   # publish_cache_events
        self.requests = RequestRegistry(config.max_finished_kept, config.max_finished_bytes, config.request_id_prefix)
        self._lock = threading.RLock()
        self.delivery = Delivery(self.requests, self._lock, config, self._wake)
        self.endings = Endings(self.scheduler, self.requests, self.delivery, config, self._lock, self._wake)
        # the consumer's side, answered by the parts that own it (thread-safe; see their docstrings)
        d = self.delivery
        self.replay, self.newest_event, self.ack, self.read_events = d.replay, d.newest_event, d.ack, d.read_events
        self.result, self.trace, self.detach_stream = d.result, d.trace, d.detach
        self.pin, self.unpin, self.forget = d.pin, d.unpin, d.forget
        self.cancel, self.cancel_all = self.endings.cancel, self.endings.cancel_all
        self.warm_grammar = self.constraints.compiler.warm   # start the grammar backend before the first use
        self._outbox: list[Event] = []      # events of requests added since the last step
        self.steps = 0                      # steps that ran the model (one that found nothing to run is not one)
        self._prompt_tokens = 0             # counters for snapshot(): prompt tokens added, tokens chosen
        self._generated_tokens = 0
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
        return int(getattr(self.model, "world", 1))

    @property
    def weight_bytes(self) -> int:
        """Bytes the model's weights take in memory (this rank's), as its forward holds them:
        quantized blocks at their size. 0 for a model that does not say (`weight_bytes`)."""
        return int(getattr(self.model, "weight_bytes", 0))

    @property
    def bytes_per_token_total(self) -> int:
        """KV bytes per token over every rank (bytes_per_token is this rank's)."""
        return self.bytes_per_token * self.tensor_parallel_size

    def shutdown(self) -> list[Event]:
        """Stop everything: end every live request (cancelled, each exactly once), then stop the
        model's worker processes, if it has any (idempotent). Returns the requests' last events.
        To end the requests and keep the engine serving, use end_all()."""
        events = self.end_all()
        self.constraints.compiler.shutdown()
        close = getattr(self.model, "close", None)
        if callable(close):
            close()
        return events

    def close(self) -> None:
        """The same as shutdown()."""
        self.shutdown()

    # -- requests in ------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, acked: bool = False,
                    attachment: Attachment | None = None, pinned: bool = False) -> str:
        """Queue a request; returns its id, or raises InvalidRequestError (nothing queued). Its
        events go to its history; acked=True gives it an ack cursor (backpressure: delivery.py).
        `attachment` (anything with `kept_bytes()`, such as the server's Track) is kept as long as
        the request is, and counted; pinned=True pins it from the moment it exists (see `pin`)."""
        failure = getattr(self.model, "failure", None)
        if failure is not None:
            from ..model.parallel import ModelUnavailableError
            raise ModelUnavailableError(f"the engine serves no more requests: {failure}")
        job = self.intake.parsed_grammar(params)          # outside the lock: the step loop goes on
        with self._lock:
            req = self.intake.make(prompt, params, self.requests.new_id() if request_id is None else request_id, job)
            self.delivery.open(req, acked, attachment)
            self._enqueue(req)
            if pinned:
                self.requests.pin(req.request_id)
        return req.request_id

    def prepare_grammar(self, params: SamplingParams | None) -> CompileJob | None:
        """Start a constrained request's parse and compile in the grammar worker (cheap, any
        thread; over the schema limits: InvalidRequestError). A server awaits `job.parsed` off its
        event loop first, so `add_request` does not wait for it."""
        return self.intake.prepare_grammar(params)

    def _enqueue(self, req: Request) -> None:
        self.requests.add(req)
        req.trace.add("added", prompt_tokens=len(req.prompt_ids), seed=req.seed,
                      deterministic=self.config.deterministic)
        req.transition(RequestState.QUEUED)
        self._prompt_tokens += len(req.prompt_ids)
        self.delivery.start(req, self.model_name, self._outbox)
        self.scheduler.add(req)
        self._wake()

    def generate(self, prompts: Any, params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run the prompts to completion; outputs in the order given. All requests are checked
        before any is queued, so a bad one raises and queues nothing."""
        prompts, plist = paired(prompts, params)
        jobs = [self.intake.parsed_grammar(sp) for sp in plist]
        with self._lock:
            reqs: list[Request] = []
            try:
                for p, sp, job in zip(prompts, plist, jobs):
                    reqs.append(self.intake.make(p, sp, self.requests.new_id(), job))
                    self.requests.live[reqs[-1].request_id] = reqs[-1]   # reserve its id meanwhile
            finally:
                for req in reqs:
                    del self.requests.live[req.request_id]
            for req in reqs:
                self._enqueue(req)
        while any(not r.state.terminal for r in reqs):
            self.step()
        return [output(r) for r in reqs]

    def has_unfinished(self) -> bool:
        return bool(self.requests.live)

    def snapshot(self) -> EngineSnapshot:
        """The engine's requests, pages, slots and counters at this moment (thread-safe, cheap)."""
        with self._lock:
            return take_snapshot(self.scheduler, self.requests.num_finished, self.steps, self._prompt_tokens,
                                 self._generated_tokens, None if self.speculator is None else self.speculator.counters)

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
            events, self._outbox = self._outbox, []
            self.endings.cancel_all()
            self.endings.safe_point(events)
        return events

    # -- the step ---------------------------------------------------------------------------------
    def step(self) -> list[Event]:
        """Schedule, run the model and choose tokens, then at the safe point commit them, apply
        cancels and deadlines and emit events. Returns this step's events in order."""
        t0 = now_us()
        with self._lock:
            events, self._outbox = self._outbox, []
            self.endings.safe_point(events)
            plan = self.scheduler.schedule(self._runnable)
            if plan.empty:
                self._flush_cache_events()
                return events
            if self.speculator is not None:
                self.speculator.extend(plan, self.scheduler, self.config.max_tokens_per_step - plan.num_tokens)
            now = time.perf_counter()
            for decode, seqs in ((True, plan.decode + plan.verify), (False, plan.prefill)):
                for s in seqs:
                    s.request.scheduled(now, decode)
        try:
            selection, failure = self._run(plan), None
        except Exception as exc:       # a device or sampler fault fails this step's requests, not the engine
            selection, failure = None, exc
        with self._lock:
            if selection is not None:
                self._commit(plan, selection, (now_us() - t0) / 1e6, events)
            else:
                self.endings.fail_step(plan, failure, events)
            self.endings.safe_point(events)
            self.steps += 1
            self.step_records.append({"step": self.steps, "t_us": t0, "dur_us": now_us() - t0,
                                      "decode": len(plan.decode), "prefill": len(plan.prefill),
                                      "verify": len(plan.verify)})
            self._flush_cache_events()
        return events

    def publish_cache_events(self, sink: Callable[[list[CacheEvent]], None] | None) -> None:
        """Hand the prefix cache's changes (page_pool.py's log: pages hashed, hashes dropped) to
        sink once per step that changed it, in order, from the step's thread under the engine
        lock (sink must be quick: pagedecode/kv_events.py queues them for its own thread).
        None stops it."""
        with self._lock:
            self.pool.record_events = sink is not None
            self.pool.events.clear()
            self._cache_sink = sink

    def _flush_cache_events(self) -> None:
        if self._cache_sink is not None and self.pool.events:
            self._cache_sink(self.pool.take_events())

    def _runnable(self, req: Request) -> bool:
        """Not scheduled: a request being cancelled, held back by its consumer (backpressure), or
        waiting for its grammar's compile."""
        if req.grammar is not None and not self.constraints.ready(req.grammar):
            return False
        return req.state != RequestState.CANCEL_REQUESTED and not self.delivery.held_back(req)

    def _run(self, plan: SchedulerOutput) -> Selection:
        """Everything between scheduling and commit; reads requests, changes none of them."""
        for req in plan.admitted:       # a (re)admitted request brings its sampler state to its slot
            self.selector.admit(req)
        batch = build_batch(plan, self.config.page_size, self.device)
        logits = self.model.forward(batch, self.kv)
        choosers = [s.request for s in plan.seqs if s.samples]
        n, scored = len(choosers), sum(c for _, _, c in batch.prompt_spans)
        drafts = sum(len(s.drafts) for s in plan.verify)
        if logits.shape[0] != n + scored + drafts:
            raise RuntimeError(f"the model returned {logits.shape[0]} rows of logits for {n} sequences"
                               + (f" and {scored} prompt positions (prompt_logprobs)" if scored else "")
                               + (f" and {drafts} draft tokens" if drafts else ""))
        assert batch.sample_slots is not None and batch.sample_index is not None
        self.selector.stage_rows(SampleRows(batch.sample_slots, batch.sample_index))   # came with the batch
        selection = self._select(logits[:n], choosers)
        if scored:
            selection.prompt = prompt_logprobs(logits[n:n + scored], batch.prompt_spans,
                                               [s.request for s in plan.seqs])
        if drafts:
            selection.drafts = logits[n + scored:]
        return selection

    def _select(self, logits: torch.Tensor, choosers: list[Request]) -> Selection:
        """One row of logits per request -> its token, with its grammar's mask for this position
        (each row's slot and output position: the staged ones, else read off the requests)."""
        bitmask = self.constraints.rows([r.grammar for r in choosers], [r.slot for r in choosers],
                                        [len(r.output_ids) for r in choosers])
        return self.selector.select(logits, choosers, bitmask)

    # -- the commit (under the lock) --------------------------------------------------------------
    def _commit(self, plan: SchedulerOutput, sel: Selection, dt: float, events: list[Event]) -> None:
        row = 0
        runs: list[tuple[ScheduledSeq, int]] = []       # verify seqs: speculative.py takes their tokens
        for k, s in enumerate(plan.seqs):
            req, i = s.request, row
            row += s.samples
            if req.state == RequestState.CANCEL_REQUESTED or req.state.terminal:
                continue                        # cancelled while the step ran: its result is discarded
            try:
                self.scheduler.advance(req, s.num_new, len(s.drafts))   # drafts count once accepted
                req.computed(s.num_new, dt)
                if sel.prompt is not None and k in sel.prompt:
                    req.add_prompt_logprobs(*sel.prompt[k])
                if s.samples and req.params.max_tokens == 0:      # prompt logprobs only: no token
                    self.endings.finish(req, FinishReason.MAX_OUTPUT_TOKENS, events)
                elif s.drafts:
                    runs.append((s, i))
                elif s.samples:
                    self._take(req, sel, i, events)
            except Exception as exc:
                self.endings.fail(req, exc, events)
        if runs:
            assert self.speculator is not None and sel.drafts is not None
            self.speculator.verify(plan.verify, runs, sel, sel.drafts, self, events, self._after_verify)

    def _take(self, req: Request, sel: Selection, i: int, events: list[Event]) -> None:
        """Commit row i's selection as req's next token (its endings checked)."""
        if i in sel.bad:
            raise FloatingPointError("the model returned non-finite logits (NaN or inf) for it")
        if i in sel.empty:
            raise RuntimeError(nothing_allowed(req))
        self._on_token(req, sel.tokens[i], None if sel.logprobs is None else sel.logprobs[i],
                       None if sel.top is None else sel.top[i], events)

    def _fail(self, req: Request, exc: BaseException, events: list[Event]) -> None:
        self.endings.fail(req, exc, events)      # speculative.py's Host

    def _after_verify(self, req: Request) -> None:
        if not (req.state.terminal or req.state == RequestState.CANCEL_REQUESTED):   # an ended one gave back everything
            self.scheduler.settle(req)

    def _on_token(self, req: Request, token: int, logprob: float | None, top: TopLogprobs | None,
                  events: list[Event]) -> None:
        req.output_ids.append(token)
        self._generated_tokens += 1
        t = len(req.output_ids)
        if req.state == RequestState.PREFILLING:
            req.transition(RequestState.DECODING)
        if req.trace.tokens:
            p = req.params
            req.trace.token("token.selected", t=t, token=token, logprob=logprob, cache_len=req.num_computed,
                            temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, seed=req.seed)
        grammar_done = req.grammar is not None and self.constraints.take(req, token)   # before its text is sent
        stop = None
        if not is_eos(req, token, self.eos_ids):
            assert req.pipeline is not None, "a live request has its output pipeline"
            em = req.pipeline.push(token, logprob, t, top)
            self.delivery.deliver(req, em, events)
            stop = em.stop
            if stop is not None:
                self.endings.stop_hit(req, stop)
        if not grammar_done and stop is None and req.grammar is not None:
            grammar_done = self.constraints.ends_after(req, token, self.eos_ids)
        reason = check_ending(req, token, stop, self.eos_ids, self.max_context, grammar_done)
        if reason is not None:
            self.endings.finish(req, reason, events)
