"""The ASGI app: OpenAI-compatible completions and chat over an AsyncEngine, keeping the request
contract over HTTP (ordered events with ids, one terminal event, usage for every ending)."""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from typing import Any, AsyncIterator, Mapping

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import InvalidRequestError
from ..runtime.async_engine import AsyncEngine, RequestStream
from ..runtime.events import DeltaEvent, RequestOutput, TerminalEvent
from ..runtime.lifecycle import FinishReason
from .chat import ChatTemplate
from .metrics import Metrics
from .protocol import (ApiError, Limits, Parsed, chat_choice, completion_choice, finish_reason, invalid, now,
                       parse_request, stop_reason, usage_body)

log = logging.getLogger("pagedecode.server")


class ServerState:
    def __init__(self, ae: AsyncEngine, model_name: str, chat_template: ChatTemplate | None, api_key: str | None,
                 limits: Limits, max_queued: int, max_body_bytes: int, defaults: Mapping[str, Any],
                 log_text: bool) -> None:
        self.ae = ae
        self.engine = ae.engine
        self.model_name = model_name
        self.chat_template = chat_template
        self.api_key = api_key
        self.limits = limits
        self.max_queued = max_queued
        self.max_body_bytes = max_body_bytes
        self.defaults = dict(defaults)
        self.log_text = log_text
        self.metrics = Metrics()
        self.draining = False

    # -- admission -------------------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        want = f"Bearer {self.api_key}"
        if not hmac.compare_digest(given.encode(), want.encode()):
            raise ApiError(401, "invalid or missing API key", code="invalid_api_key")

    async def body(self, request: Request) -> Any:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.max_body_bytes:
            raise ApiError(413, f"request body over {self.max_body_bytes} bytes")
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > self.max_body_bytes:
                raise ApiError(413, f"request body over {self.max_body_bytes} bytes")
        try:
            return json.loads(bytes(data))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"malformed JSON: {e}") from None

    def admit(self) -> None:
        if self.draining or not self.ae.running:
            raise ApiError(503, "the server is shutting down", headers={"Retry-After": "1"})
        waiting = len(self.engine.scheduler.waiting)
        if waiting >= self.max_queued:
            raise ApiError(429, f"{waiting} requests are already waiting", headers={"Retry-After": "1"})

    def prompt_of(self, parsed: Parsed) -> str | list[int]:
        if parsed.messages is None:
            assert parsed.prompt is not None
            return parsed.prompt
        if self.chat_template is None:
            raise ApiError(400, "this model has no chat template (start the server with --chat-template FILE)",
                           param="messages")
        text = self.chat_template.render(parsed.messages)
        return self.engine.tokenizer.encode(text, add_special_tokens=False)

    def submit(self, prompt: str | list[int], parsed: Parsed, n: int) -> list[RequestStream]:
        streams = []
        try:
            for i in range(n):
                params = parsed.params
                if n > 1:                          # n independent seeded requests
                    from dataclasses import replace
                    seed = None if params.seed is None else params.seed + i
                    params = replace(params, seed=seed)
                streams.append(self.ae.submit(prompt, params))
        except InvalidRequestError as e:
            for s in streams:
                self.engine.cancel(s.request_id)
            raise invalid(e) from None
        return streams

    # -- metering --------------------------------------------------------------------------
    def meter(self, out: RequestOutput, arrival: float, first: float | None, disconnected: bool) -> None:
        m = self.metrics
        u = out.usage
        m.prompt_tokens.inc(u.prompt_tokens)
        m.generation_tokens.inc(u.returned_tokens)
        m.success.labels(finished_reason=out.finish_reason.value if out.finish_reason else "none").inc()
        m.e2e.observe(time.perf_counter() - arrival)
        m.queue.observe(out.timings.queue_s)
        m.prefill.observe(out.timings.prefill_s)
        m.decode.observe(out.timings.decode_s)
        if first is not None:
            m.ttft.observe(first - arrival)
        if disconnected:
            m.disconnects.inc()
        record = {"request_id": out.request_id, "model": self.model_name, "state": out.state.value,
                  "finish_reason": out.finish_reason.value if out.finish_reason else None,
                  "prompt_tokens": u.prompt_tokens, "selected_tokens": u.selected_tokens,
                  "processed_tokens": u.processed_tokens, "returned_tokens": u.returned_tokens,
                  "queue_s": round(out.timings.queue_s, 6), "prefill_s": round(out.timings.prefill_s, 6),
                  "decode_s": round(out.timings.decode_s, 6), "disconnected": disconnected}
        if self.log_text:
            record["text"] = out.text
        log.info("request %s", json.dumps(record))


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _sse(data: Any, seq: int | None = None) -> str:
    head = f"id: {seq}\n" if seq is not None else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


def build_app(async_engine: AsyncEngine, *, model_name: str | None = None, chat_template: ChatTemplate | None = None,
              api_key: str | None = None, limits: Limits | None = None, max_queued_requests: int = 256,
              max_body_bytes: int = 1 << 20, generation_defaults: Mapping[str, Any] | None = None,
              log_text: bool = False) -> Starlette:
    """The ASGI app over a running AsyncEngine (for users who mount it in their own server)."""
    state = ServerState(async_engine, model_name or async_engine.engine.model_name, chat_template, api_key,
                        limits or Limits(), max_queued_requests, max_body_bytes, generation_defaults or {}, log_text)

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
            {"id": state.model_name, "object": "model", "created": now(), "owned_by": "pagedecode",
             "max_model_len": state.engine.max_context}]})

    async def metrics(request: Request) -> Response:
        state.metrics.refresh(state.engine)
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def generate(request: Request, chat: bool) -> Response:
        try:
            state.check_auth(request)
            body = await state.body(request)
            if isinstance(body, dict) and body.get("model") not in (None, state.model_name):
                raise ApiError(404, f"model {body.get('model')!r} is not served here (try {state.model_name!r})",
                               param="model", code="model_not_found")
            parsed = parse_request(body, chat, state.defaults, state.limits)
            if parsed.stream and parsed.n > 1:
                raise ApiError(400, "n > 1 is served without streaming only", param="n")
            state.admit()
            prompt = state.prompt_of(parsed)
            streams = state.submit(prompt, parsed, parsed.n)
        except ApiError as e:
            return _error(e)
        arrival = time.perf_counter()
        rid = streams[0].request_id
        headers = {"X-Request-Id": rid}
        if parsed.stream:
            return StreamingResponse(_stream(state, streams, parsed, chat, arrival), media_type="text/event-stream",
                                     headers={**headers, "Cache-Control": "no-cache"})
        return await _complete(state, request, streams, parsed, chat, arrival, headers)

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    app = Starlette(routes=[
        Route("/health", health), Route("/v1/models", models), Route("/metrics", metrics),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ])
    app.state.pagedecode = state
    return app


async def _collect(stream: RequestStream, first: list[float]) -> None:
    async for ev in stream:
        if isinstance(ev, DeltaEvent) and not first:
            first.append(time.perf_counter())


async def _complete(state: ServerState, request: Request, streams: list[RequestStream], parsed: Parsed, chat: bool,
                    arrival: float, headers: dict[str, str]) -> Response:
    """Wait for every choice; a client that goes away meanwhile cancels them (transport_error)."""
    firsts: list[list[float]] = [[] for _ in streams]
    tasks = [asyncio.ensure_future(_collect(s, f)) for s, f in zip(streams, firsts)]
    disconnected = False
    try:
        while not all(t.done() for t in tasks):
            await asyncio.wait(tasks, timeout=0.1)
            if not all(t.done() for t in tasks) and await request.is_disconnected():
                disconnected = True
                break
    finally:
        if disconnected or not all(t.done() for t in tasks):
            for s in streams:
                if (parsed.on_disconnect or "cancel") == "cancel":
                    state.engine.cancel(s.request_id, reason=FinishReason.TRANSPORT_ERROR)
                else:
                    state.engine.detach_stream(s.request_id)
            await asyncio.gather(*tasks, return_exceptions=True)
    outs = [state.engine.result(s.request_id) for s in streams]
    for out, f in zip(outs, firsts):
        state.meter(out, arrival, f[0] if f else None, disconnected)
    choices = []
    for i, out in enumerate(outs):
        lps = _logprobs_body(out, chat) if parsed.params.logprobs is not None else None
        choices.append((chat_choice if chat else completion_choice)(i, out, out.text, lps))
    usage = _sum_usage(outs)
    body = {"id": streams[0].request_id, "object": "chat.completion" if chat else "text_completion",
            "created": now(), "model": state.model_name, "choices": choices, "usage": usage}
    errors = [o.error for o in outs if o.error]
    if errors:
        body["pagedecode_error"] = errors[0]
    return JSONResponse(body, headers=headers)


def _sum_usage(outs: list[RequestOutput]) -> dict[str, Any]:
    total: dict[str, Any] = {}
    for o in outs:
        for k, v in usage_body(o.usage).items():
            if isinstance(v, dict):
                total.setdefault(k, {})
                for kk, vv in v.items():
                    total[k][kk] = total[k].get(kk, 0) + vv
            else:
                total[k] = total.get(k, 0) + v
    # the prompt is shared by the n choices: count it once
    total["prompt_tokens"] = outs[0].usage.prompt_tokens
    total["total_tokens"] = total["prompt_tokens"] + total["completion_tokens"]
    return total


def _logprobs_body(out: RequestOutput, chat: bool) -> Any:
    lps = out.logprobs or []
    if chat:
        return {"content": [{"token": t, "logprob": lp, "bytes": None, "top_logprobs": []}
                            for t, lp in zip(map(str, out.token_ids), lps)]}
    return {"tokens": [str(t) for t in out.token_ids], "token_logprobs": lps,
            "top_logprobs": None, "text_offset": None}


async def _stream(state: ServerState, streams: list[RequestStream], parsed: Parsed, chat: bool,
                  arrival: float) -> AsyncIterator[str]:
    """SSE: every chunk carries `id: <seq>`; the last content chunk carries finish_reason; with
    include_usage a usage chunk follows; then [DONE]. A failure is an error chunk, never silence."""
    stream = streams[0]
    rid = stream.request_id
    obj = "chat.completion.chunk" if chat else "text_completion"
    created = now()
    first: float | None = None
    last_delta: float | None = None
    terminal: TerminalEvent | None = None
    ended = False
    try:
        if chat:
            yield _sse({"id": rid, "object": obj, "created": created, "model": state.model_name,
                        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]})
        async for ev in stream:
            if isinstance(ev, DeltaEvent):
                t = time.perf_counter()
                if first is None:
                    first = t
                elif last_delta is not None:
                    state.metrics.itl.observe(t - last_delta)
                last_delta = t
                yield _sse(_chunk(rid, obj, created, state.model_name, chat, ev.text, None), ev.seq)
            elif isinstance(ev, TerminalEvent):
                terminal = ev
        ended = True
    finally:
        if not ended:                                   # the client went away (or the task was cancelled)
            if (parsed.on_disconnect or "cancel") == "cancel":
                state.engine.cancel(rid, reason=FinishReason.TRANSPORT_ERROR)
            else:
                state.engine.detach_stream(rid)
            try:
                state.meter(state.engine.result(rid), arrival, first, disconnected=True)
            except KeyError:
                pass
    out = state.engine.result(rid)
    state.meter(out, arrival, first, disconnected=False)
    assert terminal is not None
    fin: dict[str, Any] = {"index": 0, "finish_reason": finish_reason(out.finish_reason),
                           "stop_reason": stop_reason(out.stop_reason), "logprobs": None,
                           "pagedecode_finish_reason": out.finish_reason.value if out.finish_reason else None}
    if chat:
        fin["delta"] = {}
    else:
        fin["text"] = ""
    if out.error and out.finish_reason in (FinishReason.MODEL_ERROR, FinishReason.CONTENT_INTERRUPTED,
                                           FinishReason.TRANSPORT_ERROR):
        yield _sse({"error": {"message": out.error, "type": "server_error", "param": None,
                              "code": out.finish_reason.value if out.finish_reason else None}}, terminal.seq)
    else:
        yield _sse({"id": rid, "object": obj, "created": created, "model": state.model_name, "choices": [fin]},
                   terminal.seq)
    if parsed.include_usage:
        yield _sse({"id": rid, "object": obj, "created": created, "model": state.model_name, "choices": [],
                    "usage": usage_body(out.usage)})
    yield "data: [DONE]\n\n"


def _chunk(rid: str, obj: str, created: int, model: str, chat: bool, text: str, reason: str | None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": reason}
    if chat:
        choice["delta"] = {"content": text}
    else:
        choice["text"] = text
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
