"""The synchronous engine: requests in, ordered events out, one safe point per step (its checks
and every way a request ends are in terminations.py).

A step is a transaction: schedule (under the lock), then build the batch, run the model and
choose tokens without touching any request, then commit under the lock. An exception before
the commit fails that step's requests (model_error) and nothing of the step is kept; an
exception while committing one request fails that request only. Cancels and deadlines take
effect at the safe points around it.
"""
from __future__ import annotations

import random
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..errors import InvalidRequestError
from ..model.kv_cache import KVCache
from ..model.llama import configure_cpu_forward
from ..model.tokenizer import TokenizerLike, as_tokenizer
from ..params import SamplingParams
from ..protocols import Model
from .batching import build_batch
from .config import DEFAULT_CACHE_TOKENS, EngineConfig
from .endings import check_ending, is_eos
from .grammar import CompileJob, Constraints, GrammarCompiler, TokenBitmask
from .delivery import Attachment, Delivery, output
from .events import Event, RequestOutput
from .intake import make_request
from .lifecycle import FinishReason, RequestState
from .page_pool import CacheEvent, PagePool
from .prefix_cache import namespace, register as register_pages
from .registry import RequestRegistry
from .request import Request
from .scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from .selector import SampleRows, Selection, TokenSelector, TopLogprobs, prompt_logprobs
from .slots import SlotTable
from .snapshot import EngineSnapshot
from .speculative import Speculator
from .terminations import RequestEndings
from .trace import now_us


S, R = RequestState, FinishReason
ENDED = (S.DRAINING, S.FINISHED, S.CANCELLED, S.FAILED)


def nothing_allowed(req: Request) -> str:
    """Why a request's row had no token to choose: what masked them, in the order applied."""
    p, why = req.params, []
    if p.logit_bias:
        why.append("logit_bias")
    if len(req.output_ids) < p.min_tokens and (not p.ignore_eos or any(len(q) == 1 for q in p.stop_id_seqs)):
        why.append(f"min_tokens={p.min_tokens} (EOS and stop ids masked)")
    if req.grammar is not None:
        why.append("the grammar")
    masks = " and ".join(why) or "the sampling parameters"
    return f"no token is allowed at output position {len(req.output_ids) + 1}: every token is -inf after {masks}"


class Engine(RequestEndings):
    def __init__(self, model: Model, tokenizer: Any, config: EngineConfig | None = None) -> None:
        if not isinstance(model, Model):
            raise TypeError(f"model must be a pd.Model (config, device, dtype, forward), got {type(model).__name__}")
        self.model = model
        self.tokenizer: TokenizerLike = as_tokenizer(tokenizer)
        self.config = config = config or EngineConfig()
        if config.attention_backend != "auto" and hasattr(model, "attention_backend"):
            model.attention_backend = config.attention_backend
        if config.deterministic:
            if not hasattr(model, "deterministic"):
                raise ValueError(f"deterministic=True needs a model with a batch-invariant forward (a `deterministic` "
                                 f"attribute, as pagedecode's own models have); {type(model).__name__} has none")
            model.deterministic = True
        configure_cpu_forward(model, config.cpu_matmul, config.cpu_pack_weights, config.cpu_keep_freed_memory)
        mc = model.config
        self.device = torch.device(getattr(model, "device", "cpu"))
        self.bytes_per_token = KVCache.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, model.dtype)
        model_ctx = min(mc.max_context, config.max_context or mc.max_context)
        if config.memory_budget_bytes is not None:
            tokens = config.memory_budget_bytes // self.bytes_per_token
        else:
            tokens = config.max_cache_tokens or min(config.max_batch_size * model_ctx, DEFAULT_CACHE_TOKENS)
        num_pages = tokens // config.page_size
        if num_pages < 1:
            raise ValueError(f"KV capacity of {tokens} tokens holds no page of {config.page_size}")
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
        self.requests = RequestRegistry(config.max_finished_kept, config.max_finished_bytes, config.request_id_prefix)
        self._lock = threading.RLock()
        self._outbox: list[Event] = []
        self._rng = random.Random(config.seed)
        self.steps = 0              # steps that ran the model (a step that found nothing to run is not one)
        self._prompt_tokens = 0     # counters for snapshot(): prompt tokens added, tokens chosen
        self._generated_tokens = 0
        self.step_records: deque[dict[str, Any]] = deque(maxlen=4096 if config.trace != "off" else 0)
        self.selector = TokenSelector(self.eos_ids, config.max_batch_size, self.vocab_size, self.device,
                                      config.sampling_backend)
        self.wakeup: Callable[[], None] | None = None    # the async loop's "there is work" hook
        self.delivery = Delivery(self.requests, self._lock, config, self._wake)
        self._cache_sink: Callable[[list[CacheEvent]], None] | None = None   # publish_cache_events
        self.constraints = Constraints(self.tokenizer, self.vocab_size, self.eos_ids, config.max_batch_size,
                                       self.device, cache_size=config.grammar_cache_size,
                                       cache_bytes=config.grammar_cache_bytes,
                                       timeout_s=config.grammar_compile_timeout_s,
                                       max_depth=config.max_schema_depth, max_bytes=config.max_schema_bytes)
        self.speculator = (None if config.speculative is None else
                           Speculator(config.speculative, self.max_context, config.page_size, model,
                                      num_pages * config.page_size))
        # perf_counter microseconds + wall_offset_us = wall-clock microseconds (traces line up with logs)
        self.wall_offset_us = time.time() * 1e6 - now_us()

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str = "cpu", dtype: Any = None,
                        tensor_parallel_size: int = 1, quantization: str | None = None,
                        tokenizer: str | Path | None = None, **engine_options: Any) -> "Engine":
        """path: a Hugging Face directory or a GGUF file. quantization "q8_0" / "q4_0" keeps the
        layer weights quantized in memory; tokenizer: a folder holding tokenizer.json to use
        instead of the model's own. tensor_parallel_size N > 1 starts N - 1 worker processes
        (model/parallel.py); the engine and every request stay in this one."""
        from ..model.loader import load_model
        config = EngineConfig(**{"model_name": str(path), **engine_options})
        if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tensor_parallel_size!r}")
        if tensor_parallel_size == 1:
            model, tok = load_model(path, device=device, dtype=dtype, attention_backend=config.attention_backend,
                                    quantization=quantization, tokenizer=tokenizer, cpu_matmul=config.cpu_matmul,
                                    cpu_pack_weights=config.cpu_pack_weights)
            return cls(model, tok, config)
        if quantization is not None or tokenizer is not None or Path(path).is_file():
            raise ValueError("tensor_parallel_size > 1 takes a Hugging Face directory, without quantization "
                             "or tokenizer")
        from ..model.parallel import load_tensor_parallel
        model, tok = load_tensor_parallel(path, tensor_parallel_size, device=device, dtype=dtype,
                                          attention_backend=config.attention_backend)
        return cls(model, tok, config)

    @property
    def grammar(self) -> GrammarCompiler:
        """The structured-output compiler (its worker starts with the first constrained request)."""
        return self.constraints.compiler

    @property
    def bitmask(self) -> TokenBitmask:
        return self.constraints.bitmask

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

    # -- requests in ----------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, acked: bool = False,
                    attachment: Attachment | None = None, pinned: bool = False) -> str:
        """Queue a request; returns its id. Raises InvalidRequestError (nothing queued) when the
        request can never be served. Its events are kept in its history (`replay`); acked=True
        gives it an ack cursor: a consumer acks what it has taken (`ack`, or `read_events` for a
        caller that steps the engine itself), and stream_max_events unacked events (or
        stream_max_bytes of text) pause the request (backpressure). `attachment` (anything
        with `kept_bytes()`, such as the server's Track) is kept with the request, as long as the
        engine keeps it, and counts against the finished budget. pinned=True takes
        a pin (see `pin`) as the request is added, so no moment exists where it could be forgotten."""
        failure = getattr(self.model, "failure", None)
        if failure is not None:
            from ..model.parallel import ModelUnavailableError
            raise ModelUnavailableError(f"the engine serves no more requests: {failure}")
        job = self._prepare_grammar(params)          # outside the lock: the step loop goes on
        with self._lock:
            req = self._make_request(prompt, params, request_id, job)
            self.delivery.open(req, acked, attachment)
            self._enqueue(req)
            if pinned:
                self.requests.pin(req.request_id)
        return req.request_id

    def prepare_grammar(self, params: SamplingParams | None) -> CompileJob | None:
        """Start a constrained request's parse and compile in the grammar worker; cheap, any
        thread. A constraint over the schema limits raises InvalidRequestError. `add_request`
        then waits for `job.parsed` (outside the engine's lock); a server awaits it first, off
        its event loop, so add_request does not wait."""
        so = getattr(params, "structured_output", None)
        return None if so is None else self.constraints.prepare(so)

    def _prepare_grammar(self, params: SamplingParams | None) -> CompileJob | None:
        job = self.prepare_grammar(params)
        if job is not None:
            self.constraints.wait_parsed(job)
        return job

    def _make_request(self, prompt: object, params: SamplingParams | None, request_id: str | None,
                      job: CompileJob | None) -> Request:
        if request_id is None:
            request_id = self.requests.new_id()
        req = make_request(prompt, params, request_id, tokenizer=self.tokenizer, vocab_size=self.vocab_size,
                           max_context=self.max_context, rng=self._rng, trace_level=self.config.trace)
        req.cache_namespace = self._namespace(req.params.cache_salt)
        if req.params.structured_output is not None:
            assert job is not None, "a constrained request's grammar is prepared before the lock"
            req.grammar = self.constraints.attach(req.params.structured_output, job)
        return req

    def _namespace(self, salt: str | None) -> bytes:
        mc = self.model.config
        identity = f"{self.model_name}|{mc.model_type}|{mc.vocab_size}|{mc.num_layers}|{self.model.dtype}|{id(self.model)}"
        return namespace(identity, salt)

    def _enqueue(self, req: Request) -> None:
        self.requests.add(req)
        req.trace.add("added", prompt_tokens=len(req.prompt_ids), seed=req.seed,
                      deterministic=self.config.deterministic)
        req.transition(S.QUEUED)
        self._prompt_tokens += len(req.prompt_ids)
        self.delivery.start(req, self.model_name, self._outbox)
        self.scheduler.add(req)
        self._wake()

    def cancel(self, request_id: str, reason: FinishReason = R.CANCELLED) -> bool:
        """Ask to cancel; effective at the next safe point. Thread-safe. False when the request is
        unknown, terminal, or its finish reason is already fixed (draining)."""
        with self._lock:
            req = self.requests.live.get(request_id)
            if req is None or req.state in ENDED:
                return False
            if req.state != S.CANCEL_REQUESTED:
                req.trace.add("cancel.requested", reason=reason.value)
                req.cancel_reason = reason
                req.transition(S.CANCEL_REQUESTED)      # observed: nothing more is scheduled
                req.trace.add("cancel.observed")
        self._wake()
        return True

    # -- the consumer's side: delivery.py answers ----------------------------------------------
    def replay(self, request_id: str, after_seq: int = -1) -> list[Event]:
        return self.delivery.replay(request_id, after_seq)

    def newest_event(self, request_id: str) -> tuple[int, bool]:
        return self.delivery.newest_event(request_id)

    def ack(self, request_id: str, seq: int) -> None:
        self.delivery.ack(request_id, seq)

    def read_events(self, request_id: str, max_events: int | None = None) -> list[Event]:
        return self.delivery.read_events(request_id, max_events)

    def detach_stream(self, request_id: str) -> None:
        self.delivery.detach(request_id)

    def result(self, request_id: str) -> RequestOutput:
        return self.delivery.result(request_id)

    def trace(self, request_id: str) -> list[dict[str, Any]]:
        return self.delivery.trace(request_id)

    def pin(self, request_id: str) -> None:
        self.delivery.pin(request_id)

    def unpin(self, request_id: str) -> None:
        self.delivery.unpin(request_id)

    def forget(self, request_id: str) -> None:
        self.delivery.forget(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests.live)

    def _wake(self) -> None:
        if self.wakeup is not None:
            self.wakeup()

    def cancel_all(self, reason: FinishReason = R.CANCELLED) -> int:
        """Ask every live request to cancel (thread-safe, effective at the next safe point);
        returns how many were asked."""
        with self._lock:
            return sum(self.cancel(rid, reason) for rid in list(self.requests.live))

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[Event]:
        """Schedule, run the model and choose tokens, then at the safe point commit them, apply
        cancels and deadlines and emit events. Returns this step's events in order."""
        t0 = now_us()
        with self._lock:
            events, self._outbox = self._outbox, []
            self._safe_point(events)
            plan = self.scheduler.schedule(self._runnable)
            if plan.empty:
                self._flush_cache_events()
                return events
            if self.speculator is not None:
                self.speculator.extend(plan, self.scheduler, self.config.max_tokens_per_step - plan.num_tokens)
            self._begin(plan)
        try:
            selection, failure = self._run(plan), None
        except Exception as exc:       # a device or sampler fault fails this step's requests, not the engine
            selection, failure = None, exc
        with self._lock:
            if selection is not None:
                self._commit(plan, selection, (now_us() - t0) / 1e6, events)
            else:
                self._fail_step(plan, failure, events)
            self._safe_point(events)
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

    def _begin(self, plan: SchedulerOutput) -> None:
        now = time.perf_counter()
        for s in plan.seqs:
            req = s.request
            if req.first_scheduled is None:
                req.first_scheduled = now
                req.timings.queue_s = now - req.arrival
        for s in plan.decode + plan.verify:
            if s.request.trace.tokens:
                s.request.trace.token("decode.started", t=len(s.request.output_ids), cache_len=s.request.num_computed)

    def snapshot(self) -> EngineSnapshot:
        """The engine's requests, pages, slots and counters at this moment (thread-safe, cheap:
        one pass over the running and waiting requests)."""
        with self._lock:
            sch, pool, slots = self.scheduler, self.pool, self.slots
            paused = sum(r.delivery.paused_since is not None for r in sch.running) + \
                sum(r.delivery.paused_since is not None for r in sch.waiting)
            return EngineSnapshot(
                running=len(sch.running), waiting=len(sch.waiting), paused=paused,
                finished_kept=self.requests.num_finished,
                pages_used=pool.num_pages - pool.free_pages, pages_cached=pool.cached_pages,
                pages_total=pool.num_pages, slots_used=slots.num_slots - slots.free_slots,
                slots_total=slots.num_slots, preemptions=sch.preemptions,
                prefix_cache_queries=sch.cache_queries, prefix_cache_hits=sch.cache_hits,
                steps=self.steps, prompt_tokens=self._prompt_tokens, generated_tokens=self._generated_tokens,
                **self._spec_counters())

    def _spec_counters(self) -> dict[str, int]:
        if self.speculator is None:
            return {}
        c = self.speculator.counters
        return {"spec_decode_num_drafts": c.drafts, "spec_decode_num_draft_tokens": c.draft_tokens,
                "spec_decode_num_accepted_tokens": c.accepted_tokens}

    def check_integrity(self) -> None:
        """The pool's invariants, plus: no step wrote a shared or cached page."""
        self.scheduler.check_integrity()

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

    def _commit(self, plan: SchedulerOutput, sel: Selection, dt: float, events: list[Event]) -> None:
        row = 0
        caching, ps = self.config.enable_prefix_caching, self.config.page_size
        runs: list[tuple[ScheduledSeq, int]] = []       # verify seqs: speculative.py takes their tokens
        for k, s in enumerate(plan.seqs):
            req, i = s.request, row
            row += s.samples
            if req.state == S.CANCEL_REQUESTED or req.state.terminal:
                continue                        # cancelled while the step ran: its result is discarded
            try:
                req.num_computed += s.num_new - len(s.drafts)     # drafts count once accepted (speculative.py)
                req.processed_tokens += s.num_new
                if caching and req.num_computed // ps > req.pages_registered:     # a page filled
                    register_pages(self.pool, req, ps)
                if req.state == S.DECODING:
                    req.timings.decode_s += dt
                    if req.trace.tokens:
                        req.trace.token("decode.completed", t=len(req.output_ids), cache_len=req.num_computed)
                else:
                    req.timings.prefill_s += dt
                    if req.trace.tokens:
                        req.trace.token("prefill.chunk", tokens=s.num_new, cache_len=req.num_computed)
                if sel.prompt is not None and k in sel.prompt:
                    self._on_prompt_logprobs(req, *sel.prompt[k])
                if s.samples and req.params.max_tokens == 0:      # prompt logprobs only: no token
                    self._finish(req, R.MAX_OUTPUT_TOKENS, events)
                elif s.drafts:
                    runs.append((s, i))
                elif s.samples:
                    self._take(req, sel, i, events)
            except Exception as exc:
                self._fail(req, exc, events)
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

    def _after_verify(self, req: Request) -> None:
        """After a verify: key the pages its accepted tokens filled, give back the ones only
        rejected drafts used (a request that ended gave back everything already)."""
        if req.state.terminal or req.state == S.CANCEL_REQUESTED:
            return
        if self.config.enable_prefix_caching and req.num_computed // self.config.page_size > req.pages_registered:
            register_pages(self.pool, req, self.config.page_size)
        self.scheduler.trim(req)

    @staticmethod
    def _on_prompt_logprobs(req: Request, first: int, lps: list[float], tops: list[TopLogprobs] | None) -> None:
        if first != len(req.prompt_lps):
            raise RuntimeError(f"prompt logprobs from token {first} computed, but {len(req.prompt_lps)} are known")
        req.prompt_lps.extend(lps)
        req.prompt_tops.extend(tops if tops is not None else [None] * len(lps))
        if req.trace.tokens:
            req.trace.token("prompt_logprobs", first=first, count=len(lps))

    def _on_token(self, req: Request, token: int, logprob: float | None, top: TopLogprobs | None,
                  events: list[Event]) -> None:
        req.output_ids.append(token)
        self._generated_tokens += 1
        t = len(req.output_ids)
        if req.state == S.PREFILLING:
            req.transition(S.DECODING)
        if req.trace.tokens:
            p = req.params
            req.trace.token("token.selected", t=t, token=token, logprob=logprob, cache_len=req.num_computed,
                            temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, seed=req.seed)
        grammar_done = req.grammar is not None and self._grammar_accept(req, token)   # before its text is sent
        stop = None
        if not is_eos(req, token, self.eos_ids):
            assert req.pipeline is not None, "a live request has its output pipeline"
            em = req.pipeline.push(token, logprob, t, top)
            self.delivery.deliver(req, em, events)
            stop = em.stop
            if stop is not None:
                self._stop_hit(req, stop)
        if not grammar_done and stop is None and req.grammar is not None:
            grammar_done = self._grammar_must_end(req, token)
        reason = check_ending(req, token, stop, self.eos_ids, self.max_context, grammar_done)
        if reason is not None:
            self._finish(req, reason, events)

    def _grammar_accept(self, req: Request, token: int) -> bool:
        """The matcher takes the token; True when it accepted a stop token (runtime/grammar.py)."""
        if req.grammar is None:
            return False
        try:
            done = self.constraints.accept(req.grammar, token)
        except RuntimeError:
            req.trace.add("grammar.rejected", token=token)
            raise
        if done:
            req.trace.add("grammar.terminated", token=token)
            return True
        if req.trace.tokens:
            req.trace.token("grammar.accepted", token=token)
        return False

    def _grammar_must_end(self, req: Request, token: int) -> bool:
        """The grammar allows nothing but stop tokens next: complete without another forward."""
        if req.grammar is None or is_eos(req, token, self.eos_ids):
            return False
        assert req.slot is not None
        if self.constraints.must_end(req.grammar, req.slot, len(req.output_ids)):
            req.trace.add("grammar.terminated", must_end=True)
            return True
        return False

    def _runnable(self, req: Request) -> bool:
        """Not scheduled: a request being cancelled, held back by its consumer (backpressure), or
        waiting for its grammar's compile."""
        if req.grammar is not None and not self.constraints.ready(req.grammar):
            return False
        return req.state != S.CANCEL_REQUESTED and not self.delivery.held_back(req)

    def generate(self, prompts: Any, params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run the prompts to completion; outputs in the order given. All requests are checked
        before any is queued, so a bad one raises and queues nothing."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        plist: list[SamplingParams | None] = (list(params) if isinstance(params, (list, tuple))
                                              else [params] * len(prompts))  # type: ignore[list-item]
        if len(plist) != len(prompts):
            raise InvalidRequestError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        jobs = [self._prepare_grammar(sp) for sp in plist]
        with self._lock:
            reqs: list[Request] = []
            try:
                for p, sp, job in zip(prompts, plist, jobs):
                    reqs.append(self._make_request(p, sp, None, job))
                    self.requests.live[reqs[-1].request_id] = reqs[-1]   # reserve its id meanwhile
            finally:
                for req in reqs:
                    del self.requests.live[req.request_id]
            for req in reqs:
                self._enqueue(req)
        while any(not r.state.terminal for r in reqs):
            self.step()
        return [output(r) for r in reqs]

    def end_all(self) -> list[Event]:
        """End every live request (cancelled) now, each exactly once, and keep serving; returns
        the events (cancel_all() only asks, for the step loop's next safe point)."""
        with self._lock:
            events, self._outbox = self._outbox, []
            self.cancel_all()
            self._safe_point(events)
        return events
