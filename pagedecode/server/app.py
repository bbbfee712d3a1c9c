"""The ASGI app: OpenAI-compatible completions and chat over an AsyncEngine, keeping the request
contract over HTTP: ordered events with their sequence numbers as SSE ids, one terminal event,
usage for every ending, resumable streams, idempotent retries, two timeouts, admission control.

Every request the server starts has a Track: when it arrived, its first token, how often it
was retried or resumed, whether a client is attached. It is metered (metrics + one log line)
exactly once, when its terminal event is first seen, whoever sees it: the client's handler, a
resumed stream, or the watcher that follows a detached request to its end.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Mapping

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import InvalidRequestError
from ..runtime.async_engine import AsyncEngine
from ..runtime.events import DeltaEvent, Event, RequestOutput, TerminalEvent
from ..runtime.lifecycle import FinishReason
from ..runtime.trace import to_chrome
from .chat import ChatTemplate
from .metrics import Metrics
from .protocol import (ApiError, Limits, Parsed, chat_choice, completion_choice, finish_reason, invalid, now,
                       parse_request, stop_reason, usage_body)

log = logging.getLogger("pagedecode.server")
FAILURES = (FinishReason.MODEL_ERROR, FinishReason.CONTENT_INTERRUPTED, FinishReason.TRANSPORT_ERROR)


@dataclass
class Track:
    request_id: str
    arrival: float
    chat: bool
    parsed: Parsed
    first_token: float | None = None
    last_delta: float | None = None
    attached: int = 0                 # clients reading it now
    retries: int = 0
    resumes: int = 0
    disconnects: int = 0
    metered: bool = False
    grace_task: asyncio.Task[None] | None = None


@dataclass
class IdempotencyEntry:
    body_hash: str
    request_ids: list[str]
    created: float


@dataclass
class ServerOptions:
    model_name: str
    api_key: str | None = None
    limits: Limits = field(default_factory=Limits)
    max_queued_requests: int = 256
    max_body_bytes: int = 1 << 20
    generation_defaults: Mapping[str, Any] = field(default_factory=dict)
    log_text: bool = False
    resume_grace_s: float = 0.0
    on_disconnect: str = "cancel"
    idempotency_ttl_s: float = 600.0
    idempotency_max_keys: int = 10_000
    max_tracked: int = 100_000


class ServerState:
    def __init__(self, ae: AsyncEngine, chat_template: ChatTemplate | None, options: ServerOptions) -> None:
        self.ae = ae
        self.engine = ae.engine
        self.chat_template = chat_template
        self.o = options
        self.metrics = Metrics()
        self.draining = False
        self.tracks: OrderedDict[str, Track] = OrderedDict()
        self.keys: OrderedDict[str, IdempotencyEntry] = OrderedDict()
        self._preemptions_seen = 0
        self._cache_seen = (0, 0)

    # -- admission -------------------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        if self.o.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.o.api_key}".encode()):
            raise ApiError(401, "invalid or missing API key", code="invalid_api_key")

    async def body(self, request: Request) -> tuple[Any, bytes]:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.o.max_body_bytes:
            raise ApiError(413, f"request body over {self.o.max_body_bytes} bytes")
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > self.o.max_body_bytes:
                raise ApiError(413, f"request body over {self.o.max_body_bytes} bytes")
        try:
            return json.loads(bytes(data)), bytes(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"malformed JSON: {e}") from None

    def admit(self) -> None:
        if self.draining or not self.ae.running:
            raise ApiError(503, "the server is starting or shutting down", headers={"Retry-After": "1"})
        waiting = len(self.engine.scheduler.waiting)
        if waiting >= self.o.max_queued_requests:
            raise ApiError(429, f"{waiting} requests are already waiting", code="queue_full",
                           headers={"Retry-After": "1"})

    def prompt_of(self, parsed: Parsed) -> str | list[int]:
        if parsed.messages is None:
            assert parsed.prompt is not None
            return parsed.prompt
        if self.chat_template is None:
            raise ApiError(400, "this model has no chat template (start the server with --chat-template FILE)",
                           param="messages")
        text = self.chat_template.render(parsed.messages)
        return self.engine.tokenizer.encode(text, add_special_tokens=False)

    def start(self, prompt: str | list[int], parsed: Parsed, chat: bool) -> list[Track]:
        """n independent requests (seeded seed, seed + 1, ...), each with its Track."""
        tracks: list[Track] = []
        try:
            for i in range(parsed.n):
                params = parsed.params
                if parsed.n > 1 and params.seed is not None:
                    params = replace(params, seed=params.seed + i)
                rid = self.engine.add_request(prompt, params, acked=True)
                tracks.append(self._track(Track(rid, time.perf_counter(), chat, parsed)))
        except InvalidRequestError as e:
            for t in tracks:
                self.engine.cancel(t.request_id)
            raise invalid(e) from None
        return tracks

    def _track(self, t: Track) -> Track:
        self.tracks[t.request_id] = t
        while len(self.tracks) > self.o.max_tracked:
            self.tracks.popitem(last=False)
        return t

    # -- idempotency -------------------------------------------------------------------------
    def idempotent(self, key: str | None, raw: bytes) -> IdempotencyEntry | None:
        """The entry a retry attaches to; 409 for the same key with another body."""
        if key is None:
            return None
        now_s = time.monotonic()
        while self.keys and (len(self.keys) > self.o.idempotency_max_keys
                             or now_s - next(iter(self.keys.values())).created > self.o.idempotency_ttl_s):
            self.keys.popitem(last=False)
        entry = self.keys.get(key)
        if entry is None:
            return None
        if entry.body_hash != hashlib.sha256(raw).hexdigest():
            raise ApiError(409, "this Idempotency-Key was used with a different request body",
                           code="idempotency_key_reused")
        return entry

    def remember(self, key: str | None, raw: bytes, tracks: list[Track]) -> None:
        if key is not None:
            self.keys[key] = IdempotencyEntry(hashlib.sha256(raw).hexdigest(), [t.request_id for t in tracks],
                                              time.monotonic())

    # -- events, disconnects, metering --------------------------------------------------------
    def seen(self, track: Track, ev: Event) -> None:
        if isinstance(ev, DeltaEvent):
            t = time.perf_counter()
            if track.first_token is None:
                track.first_token = t
            elif track.last_delta is not None:
                self.metrics.itl.observe(t - track.last_delta)
            track.last_delta = t
        elif isinstance(ev, TerminalEvent):
            self.meter(track)

    def detached(self, track: Track, policy: str | None) -> None:
        """The last client reading the request went away before its end."""
        track.disconnects += 1
        if track.attached > 0:
            return
        policy = policy or track.parsed.on_disconnect or self.o.on_disconnect
        if policy == "continue":
            self._watch(track)
            return
        grace = self.o.resume_grace_s
        if grace <= 0:
            self.engine.cancel(track.request_id, reason=FinishReason.TRANSPORT_ERROR)
            self._watch(track)
            return

        async def cancel_later() -> None:
            await asyncio.sleep(grace)
            if track.attached == 0:
                self.engine.cancel(track.request_id, reason=FinishReason.TRANSPORT_ERROR)
        track.grace_task = asyncio.ensure_future(cancel_later())
        self._watch(track)

    def _watch(self, track: Track) -> None:
        """Follow a request nobody reads to its end, so it is metered once."""
        async def watch() -> None:
            try:
                async for ev in self.ae.follow(track.request_id, -1):
                    if isinstance(ev, TerminalEvent):
                        self.meter(track)
            except KeyError:
                pass
        asyncio.ensure_future(watch())

    def meter(self, track: Track) -> None:
        if track.metered:
            return
        try:
            out = self.engine.result(track.request_id)
        except KeyError:
            return
        if not out.state.terminal:
            return
        track.metered = True
        m = self.metrics
        u = out.usage
        m.prompt_tokens.inc(u.prompt_tokens)
        m.generation_tokens.inc(u.returned_tokens)
        m.success.labels(finished_reason=out.finish_reason.value if out.finish_reason else "none").inc()
        m.e2e.observe(time.perf_counter() - track.arrival)
        m.queue.observe(out.timings.queue_s)
        m.prefill.observe(out.timings.prefill_s)
        m.decode.observe(out.timings.decode_s)
        if track.first_token is not None:
            m.ttft.observe(track.first_token - track.arrival)
        if track.disconnects:
            m.disconnects.inc()
        record: dict[str, Any] = {
            "request_id": out.request_id, "model": self.o.model_name, "state": out.state.value,
            "finish_reason": out.finish_reason.value if out.finish_reason else None, "error": out.error,
            "prompt_tokens": u.prompt_tokens, "selected_tokens": u.selected_tokens,
            "processed_tokens": u.processed_tokens, "returned_tokens": u.returned_tokens,
            "queue_s": round(out.timings.queue_s, 6), "prefill_s": round(out.timings.prefill_s, 6),
            "decode_s": round(out.timings.decode_s, 6),
            "ttft_s": None if track.first_token is None else round(track.first_token - track.arrival, 6),
            "retries": track.retries, "resumes": track.resumes, "disconnects": track.disconnects}
        if self.o.log_text:
            record["text"] = out.text
        log.info("request %s", json.dumps(record))

    def refresh_metrics(self) -> None:
        self.metrics.refresh(self.engine)
        stats = self.engine.stats
        self.metrics.preemptions.inc(stats.preemptions - self._preemptions_seen)
        self._preemptions_seen = stats.preemptions
        sch = self.engine.scheduler
        self.metrics.prefix_queries.inc(sch.cache_queries - self._cache_seen[0])
        self.metrics.prefix_hits.inc(sch.cache_hits - self._cache_seen[1])
        self._cache_seen = (sch.cache_queries, sch.cache_hits)


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _sse(data: Any, seq: int | None = None) -> str:
    head = f"id: {seq}\n" if seq is not None else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


def build_app(async_engine: AsyncEngine, *, model_name: str | None = None, chat_template: ChatTemplate | None = None,
              **options: Any) -> Starlette:
    """The ASGI app over an AsyncEngine (started by the caller, or by `pagedecode serve`'s
    lifespan). options: the fields of ServerOptions (api_key, limits, max_queued_requests,
    max_body_bytes, generation_defaults, log_text, resume_grace_s, on_disconnect,
    idempotency_ttl_s, idempotency_max_keys)."""
    state = ServerState(async_engine, chat_template,
                        ServerOptions(model_name=model_name or async_engine.engine.model_name, **options))

    async def health(request: Request) -> Response:
        if state.draining or not state.ae.running:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def models(request: Request) -> Response:
        try:
            state.check_auth(request)
        except ApiError as e:
            return _error(e)
        return JSONResponse({"object": "list", "data": [
            {"id": state.o.model_name, "object": "model", "created": now(), "owned_by": "pagedecode",
             "max_model_len": state.engine.max_context}]})

    async def metrics(request: Request) -> Response:
        state.refresh_metrics()
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def generate(request: Request, chat: bool) -> Response:
        try:
            state.check_auth(request)
            body, raw = await state.body(request)
            if isinstance(body, dict) and body.get("model") not in (None, state.o.model_name):
                raise ApiError(404, f"model {body.get('model')!r} is not served here (try {state.o.model_name!r})",
                               param="model", code="model_not_found")
            parsed = parse_request(body, chat, state.o.generation_defaults, state.o.limits)
            if parsed.stream and parsed.n > 1:
                raise ApiError(400, "n > 1 is served without streaming only", param="n")
            key = request.headers.get("idempotency-key")
            entry = state.idempotent(key, raw)
            if entry is not None:
                tracks = [state.tracks[r] for r in entry.request_ids if r in state.tracks]
                if len(tracks) != len(entry.request_ids):
                    raise ApiError(409, "this Idempotency-Key's request is no longer kept", code="idempotency_expired")
                for t in tracks:
                    t.retries += 1
                state.metrics.replays.inc()
            else:
                state.admit()
                tracks = state.start(state.prompt_of(parsed), parsed, chat)
                state.remember(key, raw, tracks)
        except ApiError as e:
            return _error(e)
        headers = {"X-Request-Id": tracks[0].request_id}
        if parsed.stream:
            after = _last_event_id(request)
            return StreamingResponse(_sse_stream(state, tracks[0], after), media_type="text/event-stream",
                                     headers={**headers, "Cache-Control": "no-cache"})
        return await _complete(state, request, tracks, headers)

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    async def events(request: Request) -> Response:
        """Replay a request's events after Last-Event-ID (or ?after=) and follow it live."""
        try:
            state.check_auth(request)
            rid = request.path_params["request_id"]
            track = state.tracks.get(rid)
            try:
                state.engine.replay(rid, 0)
            except KeyError as e:
                raise ApiError(404, str(e.args[0]), param="request_id", code="request_not_found") from None
            if track is None:
                raise ApiError(404, f"request {rid!r} was not started by this server", param="request_id")
            track.resumes += 1
        except ApiError as e:
            return _error(e)
        return StreamingResponse(_sse_stream(state, track, _last_event_id(request)), media_type="text/event-stream",
                                 headers={"X-Request-Id": rid, "Cache-Control": "no-cache"})

    async def trace(request: Request) -> Response:
        try:
            state.check_auth(request)
            rid = request.path_params["request_id"]
            try:
                records = state.engine.trace(rid)
            except KeyError as e:
                raise ApiError(404, str(e.args[0]), param="request_id", code="request_not_found") from None
        except ApiError as e:
            return _error(e)
        return JSONResponse(to_chrome({rid: records}, wall_offset_us=state.engine.wall_offset_us))

    app = Starlette(routes=[
        Route("/health", health), Route("/v1/models", models), Route("/metrics", metrics),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/requests/{request_id}/events", events), Route("/v1/requests/{request_id}/trace", trace),
    ])
    app.state.pagedecode = state
    return app


def _last_event_id(request: Request) -> int:
    value = request.headers.get("last-event-id") or request.query_params.get("after")
    if value is None:
        return -1
    try:
        return int(value)
    except ValueError:
        return -1


async def _complete(state: ServerState, request: Request, tracks: list[Track], headers: dict[str, str]) -> Response:
    """Wait for every choice; a client that goes away meanwhile is a disconnect (its policy)."""
    async def collect(track: Track) -> None:
        async for ev in state.ae.follow(track.request_id, -1):
            state.seen(track, ev)
            state.engine.ack(track.request_id, ev.seq)
    for t in tracks:
        t.attached += 1
    tasks = [asyncio.ensure_future(collect(t)) for t in tracks]
    gone = False
    try:
        while not all(t.done() for t in tasks):
            await asyncio.wait(tasks, timeout=0.1)
            if not all(t.done() for t in tasks) and await request.is_disconnected():
                gone = True
                break
    finally:
        for t in tracks:
            t.attached -= 1
        if gone or not all(t.done() for t in tasks):
            for task in tasks:
                task.cancel()
            for t in tracks:
                state.detached(t, None)
    if gone:
        return Response(status_code=499)
    outs = [state.engine.result(t.request_id) for t in tracks]
    chat = tracks[0].chat
    parsed = tracks[0].parsed
    choices = []
    for i, out in enumerate(outs):
        lps = _logprobs_body(state, out, chat, parsed.top_logprobs) if parsed.params.logprobs is not None else None
        choices.append((chat_choice if chat else completion_choice)(i, out, out.text, lps))
    body: dict[str, Any] = {"id": tracks[0].request_id, "object": "chat.completion" if chat else "text_completion",
                            "created": now(), "model": state.o.model_name, "choices": choices,
                            "usage": _sum_usage(outs)}
    errors = [o.error for o in outs if o.error]
    if errors:
        body["pagedecode_error"] = errors[0]
    return JSONResponse(body, headers=headers)


def _sum_usage(outs: list[RequestOutput]) -> dict[str, Any]:
    total = usage_body(outs[0].usage)
    for o in outs[1:]:
        u = usage_body(o.usage)
        for k in ("completion_tokens", "selected_tokens", "processed_tokens"):
            total[k] += u[k]
    total["total_tokens"] = total["prompt_tokens"] + total["completion_tokens"]   # the prompt counts once
    return total


def _token_bytes(state: ServerState, token: int) -> bytes:
    """A token's bytes as it reads inside a text (its leading space kept), where the tokenizer
    knows them exactly; else its lone decode."""
    tok = state.engine.tokenizer
    pieces = tok.byte_pieces
    if pieces is not None and tok.is_shown(token, False):
        value = pieces.byte_fallback_value(token)
        return bytes([value]) if value is not None else pieces.token_bytes(token, False)
    return tok.decode([token], False).encode()


def _token_str(state: ServerState, token: int) -> str:
    return _token_bytes(state, token).decode("utf-8", errors="replace")


def _logprobs_body(state: ServerState, out: RequestOutput | DeltaEvent, chat: bool, top_n: int,
                   offset: int = 0) -> Any:
    """OpenAI's logprobs object for a whole output, or for one delta (streaming)."""
    lps = list(out.logprobs or [])
    tops = list(out.top_logprobs or [() for _ in lps])
    strings = [_token_str(state, t) for t in out.token_ids]
    if chat:
        return {"content": [
            {"token": s, "logprob": lp, "bytes": list(_token_bytes(state, t)),
             "top_logprobs": [{"token": _token_str(state, i), "logprob": v,
                               "bytes": list(_token_bytes(state, i))} for i, v in top[:top_n]]}
            for t, s, lp, top in zip(out.token_ids, strings, lps, tops)]}
    offsets, at = [], offset
    for s in strings:
        offsets.append(at)
        at += len(s)
    return {"tokens": strings, "token_logprobs": lps,
            "top_logprobs": [{_token_str(state, i): v for i, v in top[:top_n]} for top in tops] if top_n else None,
            "text_offset": offsets}


async def _sse_stream(state: ServerState, track: Track, after: int) -> AsyncIterator[str]:
    """SSE from the request's events after `after`: every chunk carries `id: <seq>`; the last
    content chunk carries finish_reason; with include_usage a usage chunk follows; then [DONE].
    A failure is an error chunk, never a silent end. A client that goes away is a disconnect."""
    rid = track.request_id
    chat = track.chat
    obj = "chat.completion.chunk" if chat else "text_completion"
    created = now()
    model = state.o.model_name
    terminal: TerminalEvent | None = None
    sent_chars = 0
    track.attached += 1
    if track.grace_task is not None:          # resumed within the grace period
        track.grace_task.cancel()
        track.grace_task = None
    try:
        if chat and after < 0:
            yield _sse({"id": rid, "object": obj, "created": created, "model": model,
                        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]}, 0)
        async for ev in state.ae.follow(rid, after):
            state.seen(track, ev)
            if isinstance(ev, DeltaEvent):
                chunk = _chunk(rid, obj, created, model, chat, ev.text)
                if ev.logprobs is not None:
                    chunk["choices"][0]["logprobs"] = _logprobs_body(state, ev, chat, track.parsed.top_logprobs,
                                                                     sent_chars)
                sent_chars += len(ev.text)
                yield _sse(chunk, ev.seq)
            elif isinstance(ev, TerminalEvent):
                terminal = ev
            state.engine.ack(rid, ev.seq)          # sent: the request may run on (backpressure)
    finally:
        track.attached -= 1
        if terminal is None:
            state.detached(track, None)
    assert terminal is not None
    out = state.engine.result(rid)
    fin: dict[str, Any] = {"index": 0, "finish_reason": finish_reason(out.finish_reason),
                           "stop_reason": stop_reason(out.stop_reason), "logprobs": None,
                           "pagedecode_finish_reason": out.finish_reason.value if out.finish_reason else None}
    if chat:
        fin["delta"] = {}
    else:
        fin["text"] = ""
    if out.error and out.finish_reason in FAILURES:
        yield _sse({"error": {"message": out.error, "type": "server_error", "param": None,
                              "code": out.finish_reason.value if out.finish_reason else None}}, terminal.seq)
    else:
        yield _sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [fin]}, terminal.seq)
    if track.parsed.include_usage:
        yield _sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                    "usage": usage_body(out.usage)})
    yield "data: [DONE]\n\n"


def _chunk(rid: str, obj: str, created: int, model: str, chat: bool, text: str) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": None}
    if chat:
        choice["delta"] = {"content": text}
    else:
        choice["text"] = text
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
