"""The synchronous engine: requests in, ordered events out, one safe point per step."""
from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections import OrderedDict, deque
from dataclasses import replace
from typing import Callable, Sequence

import torch

from ..errors import InvalidRequestError
from ..model.kv_cache import KVCache
from ..params import SamplingParams
from .batching import build_batch
from .config import DEFAULT_CACHE_TOKENS, EngineConfig
from .events import Event, RequestOutput, StartEvent, TerminalEvent
from .intake import make_request
from .lifecycle import FinishReason, RequestState
from .output import Emission
from .page_pool import PagePool
from .request import RESOURCES, Request
from .scheduler import Scheduler, SchedulerOutput
from .selector import TokenSelector
from .slots import SlotTable
from .stream import EventBuffer
from .trace import now_us

log = logging.getLogger("pagedecode")
S, R = RequestState, FinishReason


class Engine:
    def __init__(self, model, tokenizer, config: EngineConfig | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config = config or EngineConfig()
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
                                   self._drop_pages)
        # a sequence never holds more than the pool: that bounds the context too
        self.max_context = min(model_ctx, num_pages * config.page_size)
        self.vocab_size = mc.vocab_size
        self.eos_ids = frozenset(mc.eos_token_ids or getattr(tokenizer, "eos_token_ids", ()))
        self.model_name = config.model_name or getattr(mc, "name", None) or mc.model_type
        self._lock = threading.RLock()
        self._live: dict[str, Request] = {}
        self._done: OrderedDict[str, Request] = OrderedDict()    # terminal, oldest first
        self._outbox: list[Event] = []
        self._rng = random.Random(config.seed)
        self._auto_ids = itertools.count()
        self._step_no = 0
        self.step_records: deque[dict] = deque(maxlen=100_000)
        self.selector = TokenSelector(self.eos_ids, config.max_batch_size, self.vocab_size, self.device,
                                      config.sampling_backend)
        self.wakeup: Callable[[], None] | None = None    # the async loop's "there is work" hook

    @classmethod
    def from_pretrained(cls, path, device: str = "cpu", dtype=None, **engine_options) -> "Engine":
        from ..model.loader import load_model
        model, tokenizer = load_model(path, device=device, dtype=dtype,
                                      attention_backend=engine_options.get("attention_backend", "auto"))
        engine_options.setdefault("model_name", str(path))
        return cls(model, tokenizer, EngineConfig(**engine_options))

    # -- requests in ----------------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    stream: bool = False) -> str:
        """Queue a request; returns its id. Raises InvalidRequestError (nothing queued) when the
        request can never be served. stream=True keeps its events in a bounded buffer for
        `read_events` (backpressure applies); otherwise `step()`'s return is the delivery."""
        req = self._make_request(prompt, params, request_id, stream)
        with self._lock:
            self._enqueue(req)
        return req.request_id

    def _make_request(self, prompt, params, request_id, stream) -> Request:
        if request_id is None:
            request_id = f"req-{next(self._auto_ids)}"
        req = make_request(prompt, params, request_id, tokenizer=self.tokenizer, vocab_size=self.vocab_size,
                           max_context=self.max_context, rng=self._rng)
        if stream:
            req.buffer = EventBuffer(self.config.stream_max_events, self.config.stream_max_bytes)
            req.buffer.on_pop = self._wake
        return req

    def _enqueue(self, req: Request) -> None:
        if req.request_id in self._live:
            raise InvalidRequestError(f"request id {req.request_id!r} is still live")
        self._done.pop(req.request_id, None)          # reuse once the earlier one is terminal
        self._live[req.request_id] = req
        req.trace.add("added", prompt_tokens=len(req.prompt_ids), seed=req.seed)
        req.transition(S.QUEUED)
        self._emit(req, StartEvent(req.request_id, req.take_seq(), self.model_name), self._outbox)
        self.scheduler.add(req)
        self._wake()

    def cancel(self, request_id: str, reason: FinishReason = R.CANCELLED) -> bool:
        """Ask to cancel; effective at the next safe point. Thread-safe. False when the request is
        unknown, terminal, or its finish reason is already fixed (draining)."""
        with self._lock:
            req = self._live.get(request_id)
            if req is None or req.state in (S.DRAINING, S.FINISHED, S.CANCELLED, S.FAILED):
                return False
            if req.cancel_requested_at is None:
                req.cancel_requested_at = time.perf_counter()
                req.cancel_reason = reason
                req.trace.add("cancel.requested", reason=reason.value)
        self._wake()
        return True

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[Event]:
        """Schedule, run the model, then at the safe point apply cancels and deadlines, commit
        the selected tokens and emit events. Returns this step's events in order."""
        t0 = now_us()
        with self._lock:
            events, self._outbox = self._outbox, []
            self._safe_point(events)
            plan = self.scheduler.schedule(self._runnable)
            if plan.empty:
                return events
            self._begin(plan)
            batch = build_batch(plan, self.config.page_size, self.device)
        try:
            logits, failure = self.model.forward(batch, self.kv), None
        except Exception as exc:       # a device fault fails this step's requests, not the engine
            logits, failure = None, exc
        with self._lock:
            if failure is None:
                self._commit(plan, logits, events, (now_us() - t0) / 1e6)
            else:
                self._fail_step(plan, failure, events)
            self._safe_point(events)
            self._step_no += 1
            self.step_records.append({"step": self._step_no, "t_us": t0, "dur_us": now_us() - t0,
                                      "decode": len(plan.decode), "prefill": len(plan.prefill),
                                      "tokens": batch.num_tokens})
        return events

    def _begin(self, plan: SchedulerOutput) -> None:
        now = time.perf_counter()
        for s in plan.seqs:
            req = s.request
            if req.first_scheduled is None:
                req.first_scheduled = now
                req.timings.queue_s = now - req.arrival
        for req in plan.admitted:       # a (re)admitted request brings its sampler state to its slot
            self.selector.admit(req)
        for s in plan.decode:
            s.request.trace.add("decode.started", t=len(s.request.output_ids), cache_len=s.request.num_computed)

    def _commit(self, plan: SchedulerOutput, logits, events: list[Event], dt: float) -> None:
        choosers = []
        for s in plan.seqs:
            req = s.request
            req.num_computed += s.num_new
            req.usage.processed_tokens += s.num_new
            if s.samples:
                choosers.append(req)
        for s in plan.decode:
            s.request.timings.decode_s += dt
            s.request.trace.add("decode.completed", t=len(s.request.output_ids), cache_len=s.request.num_computed)
        for s in plan.prefill:
            s.request.timings.prefill_s += dt
            s.request.trace.add("prefill.chunk", tokens=s.num_new, cache_len=s.request.num_computed)
        rows = [i for i, req in enumerate(choosers) if req.cancel_requested_at is None and not req.state.terminal]
        if not rows:
            return
        tokens, logprobs = self.selector.select(logits[rows] if len(rows) < len(choosers) else logits,
                                                [choosers[i] for i in rows])
        for i, tok, lp in zip(rows, tokens, logprobs):
            self._on_token(choosers[i], tok, lp, events)

    def _on_token(self, req: Request, token: int, logprob: float, events: list[Event]) -> None:
        p = req.params
        req.output_ids.append(token)
        req.logprobs.append(logprob)
        req.usage.selected_tokens += 1
        t = len(req.output_ids)
        if req.state == S.PREFILLING:
            req.transition(S.DECODING)
        req.trace.add("token.selected", t=t, token=token, logprob=logprob, cache_len=req.num_computed,
                      temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, seed=req.seed)
        reason = None
        if token in self.eos_ids and not p.ignore_eos:
            reason = R.EOS
        else:
            em = req.pipeline.push(token, logprob, t)
            self._deliver(req, em, events)
            if em.stop is not None:
                reason = self._stop_hit(req, em)
        if reason is None and t >= p.max_tokens:
            reason = R.MAX_OUTPUT_TOKENS
        if reason is None and req.num_computed + 1 >= self.max_context:
            reason = R.CONTEXT_LIMIT
        if reason is not None:
            self._finish(req, reason, events)

    def _stop_hit(self, req: Request, em: Emission) -> FinishReason:
        stop = em.stop
        req.stop_reason = stop[0] if isinstance(stop, tuple) and len(stop) == 1 else stop
        req.trace.add("stop.hit", stop=req.stop_reason, rule_version=1)
        return R.STOP_SEQUENCE

    # -- endings ----------------------------------------------------------------------------
    def _finish(self, req: Request, reason: FinishReason, events: list[Event]) -> None:
        """A normal end: fix the reason (DRAINING), flush what is held, then FINISHED."""
        req.transition(S.DRAINING)
        req.finish_reason = reason
        if reason != R.STOP_SEQUENCE:
            em = req.pipeline.finish("drop" if reason == R.DEADLINE_EXCEEDED else None)
            self._deliver(req, em, events)
            if em.stop is not None:
                reason = self._stop_hit(req, em)
            if em.error is not None:
                self._terminate(req, S.FAILED, R.CONTENT_INTERRUPTED, em.error, events)
                return
        self._terminate(req, S.FINISHED, reason, None, events)

    def _terminate(self, req: Request, state: RequestState, reason: FinishReason, error: str | None,
                   events: list[Event]) -> None:
        """Fix the terminal state and emit the terminal event together (caller holds the lock),
        then release every resource once."""
        req.transition(state)
        req.finish_reason = reason
        req.error = error
        req.timings.hold_s = req.pipeline.hold_s
        req.trace.add("finish", state=state.value, reason=reason.value, error=error)
        self._emit(req, TerminalEvent(req.request_id, req.take_seq(), state, reason, replace(req.usage),
                                      error, req.stop_reason), events)
        self.scheduler.remove(req)
        for resource in RESOURCES:
            self._release(req, resource)
        self._live.pop(req.request_id, None)
        self._done[req.request_id] = req
        while len(self._done) > self.config.max_finished_kept:     # bounded memory for servers
            self._done.popitem(last=False)

    def _release(self, req: Request, resource: str) -> None:
        req.mark_released(resource)           # a second release raises DoubleReleaseError
        req.trace.add("release", resource=resource)
        try:
            if resource == "pages":
                self._drop_pages(req)
            elif resource == "slot" and req.slot is not None:
                self.slots.release(req.slot)
                req.slot = None
            elif resource == "trace":
                req.trace.closed = True
            # "rng": the seed is the whole generator state; "stream": the engine stops writing
            # to the buffer, which stays with its consumer until read
        except Exception:
            log.exception("releasing %s of request %s failed", resource, req.request_id)

    def _drop_pages(self, req: Request) -> None:
        pages, req.pages = req.pages, []
        if pages:
            self.pool.release(pages)

    def _fail_step(self, plan: SchedulerOutput, exc: Exception, events: list[Event]) -> None:
        log.error("model step failed: %s: %s", type(exc).__name__, exc)
        for s in plan.seqs:
            req = s.request
            if req.state.terminal or req.cancel_requested_at is not None:
                continue
            self._terminate(req, S.FAILED, R.MODEL_ERROR, f"model step failed: {type(exc).__name__}: {exc}",
                            events)

    def _safe_point(self, events: list[Event]) -> None:
        now = time.perf_counter()
        for req in list(self._live.values()):
            if req.cancel_requested_at is not None:
                req.trace.add("cancel.observed")
                req.transition(S.CANCEL_REQUESTED)
                req.trace.add("cancel.effective")
                self._terminate(req, S.CANCELLED, req.cancel_reason, None, events)
            elif req.deadline is not None and now >= req.deadline:
                req.trace.add("deadline", state=req.state.value)
                if req.state == S.DECODING:
                    self._finish(req, R.DEADLINE_EXCEEDED, events)
                else:
                    self._terminate(req, S.FAILED, R.DEADLINE_EXCEEDED,
                                    "deadline passed before decoding started", events)
            elif (req.paused_since is not None and self.config.backpressure == "fail"
                  and now - req.paused_since > self.config.backpressure_timeout_s):
                self._terminate(req, S.FAILED, R.TRANSPORT_ERROR,
                                f"consumer did not read for {self.config.backpressure_timeout_s}s", events)

    def _runnable(self, req: Request) -> bool:
        """Not scheduled: a request being cancelled, or held back by its full outgoing buffer."""
        return req.cancel_requested_at is None and not req.backpressured()

    # -- events out ---------------------------------------------------------------------------
    def _deliver(self, req: Request, em: Emission, events: list[Event]) -> None:
        if em.text or em.token_ids:
            self._emit(req, req.delta(em), events)

    def _emit(self, req: Request, ev: Event, events: list[Event]) -> None:
        req.history.append(ev)
        events.append(ev)
        if req.buffer is not None and "stream" not in req.released:
            req.buffer.push(ev)

    def _wake(self) -> None:
        if self.wakeup is not None:
            self.wakeup()

    # -- reading ------------------------------------------------------------------------------
    def _get(self, request_id: str) -> Request:
        req = self._live.get(request_id) or self._done.get(request_id)
        if req is None:
            raise KeyError(f"unknown request id {request_id!r}")
        return req

    def read_events(self, request_id: str, max_events: int | None = None) -> list[Event]:
        """Take events from a streaming request's buffer (making room: backpressure lifts)."""
        req = self._get(request_id)
        if req.buffer is None:
            raise ValueError(f"request {request_id!r} was not added with stream=True")
        return req.buffer.pop(max_events)

    def detach_stream(self, request_id: str) -> None:
        """The consumer left but the request goes on: stop buffering its events (they stay in
        its history for replay), so backpressure no longer holds it."""
        with self._lock:
            req = self._get(request_id)
            if req.buffer is not None:
                req.buffer = None
                req.paused_since = None
        self._wake()

    def replay(self, request_id: str, after_seq: int = -1) -> list[Event]:
        """Every event of the request with seq > after_seq, in order (for a reconnecting client)."""
        with self._lock:
            return [e for e in self._get(request_id).history if e.seq > after_seq]

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def result(self, request_id: str) -> RequestOutput:
        with self._lock:
            return self._get(request_id).to_output()

    def trace(self, request_id: str) -> list[dict]:
        return list(self._get(request_id).trace.records)

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run the prompts to completion; outputs in the order given. All requests are checked
        before any is queued, so a bad one raises and queues nothing."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidRequestError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        reqs = [self._make_request(p, sp, None, False) for p, sp in zip(prompts, plist)]
        with self._lock:
            for req in reqs:
                self._enqueue(req)
        while any(not r.state.terminal for r in reqs):
            self.step()
        return [self.result(r.request_id) for r in reqs]

    def shutdown(self) -> list[Event]:
        """End every live request (cancelled) at once, each exactly once; returns the events."""
        events: list[Event] = []
        with self._lock:
            events, self._outbox = self._outbox, []
            for rid in list(self._live):
                self.cancel(rid)
            self._safe_point(events)
        return events

    def forget(self, request_id: str) -> None:
        """Drop a terminal request's stored result and history."""
        with self._lock:
            self._done.pop(request_id, None)
