"""POST /v1/completions and /v1/chat/completions: parse (protocol.py), admit, start the
requests (or attach a retry to the ones its Idempotency-Key started), then answer as SSE
(sse.py) or, once every choice has ended, as one body."""
from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from .errors import ApiError
from .idempotency import IdempotencyEntry, key_of
from .protocol import Parsed, parse_request
from .responses import (chat_choice, completion_choice, echo_logprobs_body, logprobs_body, prompt_logprobs_body,
                        sum_usage)
from .sse import check_resume, choices_sse, last_event_id, one_sse, pin
from .state import ServerState, state_of
from .tracks import Track

SSE_HEADERS = {"Cache-Control": "no-cache"}


async def completions(request: Request) -> Response:
    return await generate(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await generate(request, chat=True)


async def generate(request: Request, chat: bool) -> Response:
    state = state_of(request)
    tenant = state.tenants.check(request)
    body, raw = await state.read_body(request)
    state.check_model(body)
    options = state.options
    parsed = parse_request(body, chat, options.generation_defaults, options.limits, options.max_prompts_per_request)
    await state.prepare_grammar(parsed, body)
    key = key_of(request.headers.get("idempotency-key"), tenant, "chat" if chat else "completions")
    entry = state.keys.find(key, raw)
    after = last_event_id(request) if parsed.sse else None
    many = max(1, len(parsed.prompts)) * parsed.n > 1       # several choices: one merged stream
    if entry is not None:
        tracks = _retried(state, entry, parsed, after, many)
    else:
        prompts = state.prompts_of(parsed)
        state.admit(len(prompts) * parsed.n)
        tracks = state.start(prompts, parsed, chat, tenant)   # pinned
        state.keys.remember(key, raw, [t.request_id for t in tracks])
        after = None             # a new request: nothing of it was seen, whatever Last-Event-ID says
    headers = {"X-Request-Id": tracks[0].request_id}
    if parsed.sse:
        frames = one_sse(state, tracks[0], after) if not many else choices_sse(state, tracks, parsed.n)
        return StreamingResponse(frames, media_type="text/event-stream", headers={**headers, **SSE_HEADERS})
    return await _complete(state, request, tracks, parsed.n, headers)


def _retried(state: ServerState, entry: IdempotencyEntry, parsed: Parsed, after: int | None, many: bool
             ) -> list[Track]:
    """The requests a retry with the same Idempotency-Key attaches to, pinned."""
    if many and after is not None:
        raise ApiError(400, "a stream of several choices (a batch of prompts, or n > 1) has no event "
                            "ids to resume after: retry without Last-Event-ID (the same Idempotency-Key "
                            "replays it from the start)", param="Last-Event-ID", code="resume_not_supported")
    tracks = [t for t in map(state.tracks.get, entry.request_ids) if t is not None]
    if len(tracks) != len(entry.request_ids):
        raise ApiError(409, "this Idempotency-Key's request is no longer kept", code="idempotency_expired")
    pin(state, tracks, code="idempotency_expired")
    if parsed.sse and not many:
        check_resume(state, tracks[0], after)
    for t in tracks:
        t.retries += 1
    state.metrics.replays.inc()
    return tracks


async def _complete(state: ServerState, request: Request, tracks: list[Track], n: int, headers: dict[str, str]
                    ) -> Response:
    """Wait for every choice; a client that goes away meanwhile is a disconnect (its policy).
    Holds one pin per request (taken by the caller), released once the result is built."""
    try:
        if not await state.wait_all(request, tracks):
            return Response(status_code=499)
        return JSONResponse(_body(state, tracks, n), headers=headers)
    finally:
        for t in tracks:
            state.engine.unpin(t.request_id)


def _body(state: ServerState, tracks: list[Track], n: int) -> dict[str, Any]:
    outs = [state.engine.result(t.request_id) for t in tracks]
    chat, reply, tok = tracks[0].chat, tracks[0].reply, state.engine.tokenizer
    choices = []
    for i, out in enumerate(outs):
        text, echo = out.text, tracks[i].reply.echo
        if echo is not None:
            lps = echo_logprobs_body(tok, out, reply.top_logprobs) if reply.logprobs else None
            text = echo + text
        else:
            lps = logprobs_body(tok, out, chat, reply.top_logprobs) if reply.logprobs else None
        choices.append((chat_choice if chat else completion_choice)(i, out, text, lps))
        if reply.prompt_logprobs is not None:
            choices[-1]["prompt_logprobs"] = prompt_logprobs_body(tok, out)
    body: dict[str, Any] = {"id": tracks[0].request_id, "object": "chat.completion" if chat else "text_completion",
                            "created": tracks[0].created, "model": state.options.model_name, "choices": choices,
                            "usage": sum_usage(outs, n)}
    errors = [o.error for o in outs if o.error]
    if errors:
        body["pagedecode_error"] = errors[0]
    return body
