"""The ASGI app: OpenAI-compatible completions and chat (and the Responses API, responses_api.py) over an AsyncEngine, keeping the request
contract over HTTP: ordered events with their sequence numbers as SSE ids, one terminal event,
usage for every ending, resumable streams, idempotent retries, two timeouts, admission control.
Per-request bookkeeping (tracks, idempotency, disconnects, metering) is in state.py; response
shapes in responses.py.
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..runtime.async_engine import AsyncEngine
from ..runtime.events import DeltaEvent, Event, RequestOutput, TerminalEvent
from ..runtime.lifecycle import FinishReason, RequestState
from ..runtime.trace import to_chrome
from .chat import ChatTemplate
from .guard import RequestGuard
from .protocol import ApiError, chat_choice, completion_choice, finish_reason, now, parse_request, stop_reason, usage_body
from .responses import chunk_body, echo_logprobs_body, logprobs_body, prompt_logprobs_body, sse, sum_usage
from .responses_api import routes as responses_routes
from .state import ServerOptions, ServerState, Track

MAX_IDEMPOTENCY_KEY_CHARS = 255
FAILURES = (FinishReason.MODEL_ERROR, FinishReason.CONTENT_INTERRUPTED, FinishReason.TRANSPORT_ERROR)


def _stream_error(out: RequestOutput) -> bool:
    """Whether a stream ends in an error chunk: a failure reason, or any request that FAILED with
    an error (a deadline before the first token: the non-streaming answer's pagedecode_error)."""
    return bool(out.error) and (out.finish_reason in FAILURES or out.state == RequestState.FAILED)


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own answers (no such route 404, method not allowed 405, OPTIONS included:
    there is no CORS) in OpenAI's error body."""
    assert isinstance(exc, HTTPException)
    what = {404: f"no route {request.url.path}",
            405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return _error(ApiError(exc.status_code, what, code=code, headers=exc.headers))


async def _server_error(request: Request, exc: Exception) -> Response:
    """A bug, never an answer to input: still OpenAI's body (the traceback goes to the log)."""
    return _error(ApiError(500, "internal server error", code="internal_error"))


def build_app(async_engine: AsyncEngine, *, model_name: str | None = None, chat_template: ChatTemplate | None = None,
              **options: Any) -> Starlette:
    """The ASGI app over an AsyncEngine (started by the caller, or by `pagedecode serve`'s
    lifespan). options: the fields of ServerOptions (state.py: api_key / api_keys, metrics_public,
    allowed_hosts, allow_special_tokens_in_content, limits, max_queued_requests, max_prompts_per_request,
    max_body_bytes,
    generation_defaults, log_text, resume_grace_s, on_disconnect, idempotency_ttl_s,
    idempotency_max_keys, ...)."""
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
        try:
            state.check_metrics_auth(request)
        except ApiError as e:
            return _error(e)
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def generate(request: Request, chat: bool) -> Response:
        try:
            tenant = state.check_auth(request)
            body, raw = await state.body(request)
            state.check_model(body)
            parsed = parse_request(body, chat, state.o.generation_defaults, state.o.limits,
                                   state.o.max_prompts_per_request)
            await state.prepare_grammar(parsed, body)
            header = request.headers.get("idempotency-key")
            if header is not None and len(header) > MAX_IDEMPOTENCY_KEY_CHARS:      # kept for its TTL: bounded
                raise ApiError(400, f"Idempotency-Key: at most {MAX_IDEMPOTENCY_KEY_CHARS} characters",
                               param="Idempotency-Key", code="invalid_value")
            key = None if header is None else (tenant, "chat" if chat else "completions", header)
            entry = state.idempotent(key, raw)
            after = _resume_point(request) if parsed.stream else -1
            many = max(1, len(parsed.prompts)) * parsed.n > 1       # several choices: one merged stream
            if entry is not None:
                if many and after >= 0:
                    raise ApiError(400, "a stream of several choices (a batch of prompts, or n > 1) has no event "
                                        "ids to resume after: retry without Last-Event-ID (the same Idempotency-Key "
                                        "replays it from the start)", param="Last-Event-ID",
                                   code="resume_not_supported")
                tracks = [t for t in map(state.tracks.get, entry.request_ids) if t is not None]
                if len(tracks) != len(entry.request_ids):
                    raise ApiError(409, "this Idempotency-Key's request is no longer kept", code="idempotency_expired")
                _pin(state, tracks, code="idempotency_expired")
                if parsed.stream and not many:
                    _check_resume(state, tracks[0], after)
                for t in tracks:
                    t.retries += 1
                state.metrics.replays.inc()
            else:
                prompts = state.prompts_of(parsed)
                state.admit(len(prompts) * parsed.n)
                tracks = state.start(prompts, parsed, chat, tenant)   # pinned
                state.remember(key, raw, tracks)
                after = -1             # a new request: nothing of it was seen, whatever Last-Event-ID says
        except ApiError as e:
            return _error(e)
        headers = {"X-Request-Id": tracks[0].request_id}
        if parsed.stream:
            frames = _sse_stream(state, tracks[0], after) if not many else _sse_choices(state, tracks, parsed.n)
            return StreamingResponse(frames, media_type="text/event-stream",
                                     headers={**headers, "Cache-Control": "no-cache"})
        return await _complete(state, request, tracks, parsed.n, headers)

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    async def events(request: Request) -> Response:
        """Replay a request's events after Last-Event-ID (or ?after=) and follow it live."""
        try:
            rid = request.path_params["request_id"]
            track = state.owned(state.check_auth(request), rid)
            after = _resume_point(request)
            _pin(state, [track], code="request_not_found", status=404)
            _check_resume(state, track, after)
            track.resumes += 1
        except ApiError as e:
            return _error(e)
        return StreamingResponse(_sse_stream(state, track, after), media_type="text/event-stream",
                                 headers={"X-Request-Id": rid, "Cache-Control": "no-cache"})

    async def trace(request: Request) -> Response:
        try:
            rid = request.path_params["request_id"]
            state.owned(state.check_auth(request), rid)
            try:
                records = state.engine.trace(rid)
            except KeyError as e:
                raise ApiError(404, str(e.args[0]), param="request_id", code="request_not_found") from None
        except ApiError as e:
            return _error(e)
        return JSONResponse(to_chrome({rid: records}, wall_offset_us=state.engine.wall_offset_us))

    app = Starlette(middleware=[Middleware(RequestGuard, allowed_hosts=state.o.allowed_hosts)], routes=[
        Route("/health", health), Route("/v1/models", models), Route("/metrics", metrics),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/requests/{request_id}/events", events), Route("/v1/requests/{request_id}/trace", trace),
        *responses_routes(state),
    ], exception_handlers={HTTPException: _http_error, 500: _server_error})
    app.state.pagedecode = state
    return app


def _resume_point(request: Request) -> int:
    """Last-Event-ID (or ?after=): resume after that SSE id; -1 (absent) is from the start."""
    header = request.headers.get("last-event-id")
    name, value = ("Last-Event-ID", header) if header else ("after", request.query_params.get("after"))
    if value is None:
        return -1
    try:
        after = int(value)
    except ValueError:
        raise ApiError(400, f"{name} must be an event id (an integer >= -1), got {value!r}", param=name) from None
    if after < -1:
        raise ApiError(400, f"{name} must be an event id (an integer >= -1), got {after}", param=name)
    return after


def _stream_end(state: ServerState, track: Track) -> tuple[int, int | None]:
    """The newest SSE id the request's stream has so far, and its terminal event's seq (None
    while live). Ids are event seqs; the usage chunk, after the terminal event, is terminal + 1."""
    newest, ended = state.engine.newest_event(track.request_id)
    if not ended:
        return newest, None
    return newest + (1 if track.reply.include_usage else 0), newest


def _check_resume(state: ServerState, track: Track, after: int) -> None:
    """An id no chunk has carried yet cannot have been seen: 400, and the pin taken is released."""
    last, _ = _stream_end(state, track)
    if after > last:
        state.engine.unpin(track.request_id)
        raise ApiError(400, f"Last-Event-ID {after} is beyond the last event of request {track.request_id!r} "
                            f"(id {last})", param="Last-Event-ID", code="event_id_out_of_range")


def _pin(state: ServerState, tracks: list[Track], code: str, status: int = 409) -> None:
    """Pin each request for the handler about to read it (released when it ends)."""
    for i, t in enumerate(tracks):
        try:
            state.engine.pin(t.request_id)
        except KeyError as e:
            for held in tracks[:i]:
                state.engine.unpin(held.request_id)
            raise ApiError(status, str(e.args[0]), param="request_id", code=code) from None


async def _complete(state: ServerState, request: Request, tracks: list[Track], n: int, headers: dict[str, str]
                    ) -> Response:
    """Wait for every choice; a client that goes away meanwhile is a disconnect (its policy).
    Holds one pin per request (taken by the caller), released once the result is built."""
    try:
        return await _collect_all(state, request, tracks, n, headers)
    finally:
        for t in tracks:
            state.engine.unpin(t.request_id)


async def _collect_all(state: ServerState, request: Request, tracks: list[Track], n: int, headers: dict[str, str]
                       ) -> Response:
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
    chat, reply = tracks[0].chat, tracks[0].reply
    choices = []
    for i, out in enumerate(outs):
        text, echo = out.text, tracks[i].reply.echo
        if echo is not None:
            lps = echo_logprobs_body(state, out, reply.top_logprobs) if reply.logprobs else None
            text = echo + text
        else:
            lps = logprobs_body(state, out, chat, reply.top_logprobs) if reply.logprobs else None
        choices.append((chat_choice if chat else completion_choice)(i, out, text, lps))
        if reply.prompt_logprobs is not None:
            choices[-1]["prompt_logprobs"] = prompt_logprobs_body(state, out)
    body: dict[str, Any] = {"id": tracks[0].request_id, "object": "chat.completion" if chat else "text_completion",
                            "created": tracks[0].created, "model": state.o.model_name, "choices": choices,
                            "usage": sum_usage(outs, n)}
    errors = [o.error for o in outs if o.error]
    if errors:
        body["pagedecode_error"] = errors[0]
    return JSONResponse(body, headers=headers)


async def _sse_stream(state: ServerState, track: Track, after: int) -> AsyncIterator[str]:
    """SSE from the request's events after SSE id `after`, then [DONE]. Every chunk carries an id:
    the chat role chunk its start event's seq (0), content chunks their delta's seq, the finish
    (or error) chunk the terminal event's seq T, the usage chunk (include_usage) T + 1; so a
    resume after T sends the usage chunk and [DONE], after T + 1 only [DONE]. Chunks are built
    from what the request kept (`created` is the request's), so a replay is byte-identical.
    A client that goes away is a disconnect. Holds a pin (taken by the caller) until it ends."""
    try:
        async for frame in _sse_frames(state, track, after):
            yield frame
    finally:
        state.engine.unpin(track.request_id)


async def _sse_frames(state: ServerState, track: Track, after: int) -> AsyncIterator[str]:
    rid = track.request_id
    chat = track.chat
    obj = "chat.completion.chunk" if chat else "text_completion"
    created = track.created
    model = state.o.model_name
    _, terminal = _stream_end(state, track)
    sent_chars = 0
    if after >= 0 and not chat and track.reply.logprobs:     # text_offset goes on
        sent_chars = sum(len(e.text) for e in state.engine.replay(rid, -1)
                         if isinstance(e, DeltaEvent) and e.seq <= after)
    track.attached += 1
    if track.grace_task is not None:          # resumed within the grace period
        track.grace_task.cancel()
        track.grace_task = None
    try:
        if chat and after < 0:
            yield sse({"id": rid, "object": obj, "created": created, "model": model,
                        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]}, 0)
        if terminal is None or after < terminal:
            async for ev in state.ae.follow(rid, after):
                state.seen(track, ev)
                if isinstance(ev, DeltaEvent):
                    chunk = chunk_body(rid, obj, created, model, chat, ev.text)
                    if ev.logprobs is not None:
                        chunk["choices"][0]["logprobs"] = logprobs_body(state, ev, chat, track.reply.top_logprobs,
                                                                         sent_chars)
                    sent_chars += len(ev.text)
                    yield sse(chunk, ev.seq)
                elif isinstance(ev, TerminalEvent):
                    terminal = ev.seq
                state.engine.ack(rid, ev.seq)          # sent: the request may run on (backpressure)
    finally:
        track.attached -= 1
        if terminal is None:
            state.detached(track, None)
    assert terminal is not None
    out = state.engine.result(rid)
    if after < terminal:
        yield _finish_frame(out, {"id": rid, "object": obj, "created": created, "model": model}, chat, 0, terminal)
    if track.reply.include_usage and after <= terminal:
        yield sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                    "usage": usage_body(out.usage)}, terminal + 1)
    yield "data: [DONE]\n\n"




def _finish_frame(out: RequestOutput, head: dict[str, Any], chat: bool, index: int, seq: int | None) -> str:
    """A choice's last chunk: its finish reason, or the error it failed with."""
    if _stream_error(out):
        return sse({"error": {"message": out.error, "type": "server_error", "param": None,
                              "code": out.finish_reason.value if out.finish_reason else None}}, seq)
    fin: dict[str, Any] = {"index": index, "finish_reason": finish_reason(out.finish_reason),
                           "stop_reason": stop_reason(out.stop_reason), "logprobs": None,
                           "pagedecode_finish_reason": out.finish_reason.value if out.finish_reason else None}
    if chat:
        fin["delta"] = {}
    else:
        fin["text"] = ""
    return sse({**head, "choices": [fin]}, seq)


async def _sse_choices(state: ServerState, tracks: list[Track], n: int) -> AsyncIterator[str]:
    """One SSE stream of several choices (a batch of prompts, n > 1, or both), prompt-major:
    prompt i, sample j is choice i * n + j. Each choice's chunks go out as its events come,
    carrying its index (chat: every choice's role chunk first); each choice's finish (or error)
    chunk when it ends; then one usage chunk summed over them (include_usage) and [DONE]. Chunks
    carry no SSE id (the choices' events have no one order to resume after: a retry with the same
    Idempotency-Key replays the stream from the start; each choice's own request stays readable at
    /v1/requests/{id}/events). A client that goes away is a disconnect of every choice still
    running. Holds a pin per request (taken by the caller) until it ends."""
    try:
        async for frame in _choice_frames(state, tracks, n):
            yield frame
    finally:
        for t in tracks:
            state.engine.unpin(t.request_id)


async def _choice_frames(state: ServerState, tracks: list[Track], n: int) -> AsyncIterator[str]:
    chat, reply = tracks[0].chat, tracks[0].reply
    rid, obj, created, model = (tracks[0].request_id, "chat.completion.chunk" if chat else "text_completion",
                                tracks[0].created, state.o.model_name)
    head: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model}
    queue: asyncio.Queue[tuple[int, Event | None]] = asyncio.Queue()

    async def follow(i: int, track: Track) -> None:
        try:
            async for ev in state.ae.follow(track.request_id, -1):
                queue.put_nowait((i, ev))
        finally:
            queue.put_nowait((i, None))          # this choice has no more events
    ended = [False] * len(tracks)
    sent_chars = [0] * len(tracks)
    for t in tracks:
        t.attached += 1
        if t.grace_task is not None:             # retried within the grace period
            t.grace_task.cancel()
            t.grace_task = None
    tasks = [asyncio.ensure_future(follow(i, t)) for i, t in enumerate(tracks)]
    try:
        if chat:
            for i in range(len(tracks)):
                yield sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]})
        left = len(tracks)
        while left:
            i, ev = await queue.get()
            track = tracks[i]
            if ev is None:
                left -= 1
                continue
            state.seen(track, ev)
            if isinstance(ev, DeltaEvent):
                chunk = chunk_body(rid, obj, created, model, chat, ev.text, i)
                if ev.logprobs is not None:
                    chunk["choices"][0]["logprobs"] = logprobs_body(state, ev, chat, reply.top_logprobs,
                                                                     sent_chars[i])
                sent_chars[i] += len(ev.text)
                yield sse(chunk)
            elif isinstance(ev, TerminalEvent):
                ended[i] = True
                yield _finish_frame(state.engine.result(track.request_id), head, chat, i, None)
            state.engine.ack(track.request_id, ev.seq)       # sent: the request may run on (backpressure)
        for task in tasks:
            task.result()                        # a follower's failure is this stream's
    finally:
        for task in tasks:
            task.cancel()
        for t in tracks:
            t.attached -= 1
        for t, done in zip(tracks, ended):
            if not done:
                state.detached(t, None)
    if reply.include_usage:
        outs = [state.engine.result(t.request_id) for t in tracks]
        yield sse({**head, "choices": [], "usage": sum_usage(outs, n)})
    yield "data: [DONE]\n\n"
