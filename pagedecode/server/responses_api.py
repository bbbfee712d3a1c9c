"""The Responses API: POST /v1/responses, GET / DELETE /v1/responses/{id}, POST .../cancel.

The body becomes a chat body (responses_input.py); the response runs as one engine request
whose id is the response id (`resp_` and 128 random bits) with its Track: its tenant owns it
(others get 404), pins keep it until it is sent, and it lives as long as the engine keeps its
record (the finished-request budget). Its object and its event stream: responses_output.py.
"""
from __future__ import annotations

import secrets

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .errors import ApiError, bad
from .responses_input import parse_body, renamed
from .responses_output import response_body, response_sse, status_of
from .state import ServerState, state_of
from .tracks import Track


def not_found(rid: str) -> ApiError:
    return ApiError(404, f"no response with id {rid!r}", param="response_id", code="response_not_found")


def stored(state: ServerState, request: Request) -> Track:
    """The tenant's stored response named in the path; 404 for another tenant's, one made with
    store: false, a deleted one, or one the engine no longer keeps."""
    rid = request.path_params["response_id"]
    track = state.tracks.get(rid)
    if track is None or track.tenant != state.tenants.check(request) or track.response is None \
            or not track.response.store or track.response.deleted:
        raise not_found(rid)
    return track


def pinned(state: ServerState, track: Track) -> None:
    try:
        state.engine.pin(track.request_id)
    except KeyError:
        raise not_found(track.request_id) from None


def _answer(state: ServerState, track: Track, headers: dict[str, str] | None = None) -> JSONResponse:
    out = state.engine.result(track.request_id)
    return JSONResponse(response_body(state, track, status_of(out), out), headers=headers)


async def _started(state: ServerState, request: Request) -> tuple[Track, bool]:
    """The new response's Track (pinned) and whether to stream it; errors name Responses fields."""
    try:
        tenant = state.tenants.check(request)
        body, _ = await state.read_body(request)
        state.check_model(body)
        parsed, meta = parse_body(body, state.options.generation_defaults, state.options.limits)
        await state.prepare_grammar(parsed, {"response_format": True})
        state.admit()
        [track] = state.start(state.prompts_of(parsed), parsed, True, tenant,
                              request_id=state.options.response_id_prefix + secrets.token_hex(16), response=meta)
    except ApiError as e:
        raise renamed(e) from None
    return track, parsed.sse


async def create(request: Request) -> Response:
    state = state_of(request)
    track, sse = await _started(state, request)
    assert track.response is not None
    rid = track.request_id
    headers = {"X-Request-Id": rid}
    if track.response.background:
        state.engine.detach_stream(rid)       # nobody has to read it for it to run on
        state.watch(track)                    # metered when it ends
    if sse:
        return StreamingResponse(response_sse(state, track, None), media_type="text/event-stream",
                                 headers={**headers, "Cache-Control": "no-cache"})
    try:
        if not track.response.background and not await state.wait_all(request, [track]):
            return Response(status_code=499)
        return _answer(state, track, headers)
    finally:
        state.engine.unpin(rid)


def starting_after(request: Request) -> int | None:
    """?starting_after=N: the stream resumes after event N (None, or -1: from the start)."""
    value = request.query_params.get("starting_after")
    if value is None:
        return None
    try:
        after = int(value)
    except ValueError:
        after = -2
    if after < -1:
        raise bad("starting_after", f"must be a sequence number (an integer >= -1), got {value!r}")
    return None if after == -1 else after


async def retrieve(request: Request) -> Response:
    state = state_of(request)
    track = stored(state, request)
    if request.query_params.get("stream", "false").lower() not in ("true", "1"):
        try:
            return _answer(state, track)
        except KeyError:
            raise not_found(track.request_id) from None
    after = starting_after(request)
    pinned(state, track)
    track.resumes += 1
    return StreamingResponse(response_sse(state, track, after), media_type="text/event-stream",
                             headers={"X-Request-Id": track.request_id, "Cache-Control": "no-cache"})


async def cancel(request: Request) -> Response:
    state = state_of(request)
    track = stored(state, request)
    assert track.response is not None
    if not track.response.background:
        raise ApiError(400, "only responses created with background: true can be cancelled",
                       param="response_id", code="invalid_value")
    pinned(state, track)
    rid = track.request_id
    try:
        state.engine.cancel(rid)
        async for _ in state.async_engine.follow(rid, -1):     # to its terminal event: the cancel is effective
            pass
        return _answer(state, track)
    finally:
        state.engine.unpin(rid)


async def delete(request: Request) -> Response:
    state = state_of(request)
    track = stored(state, request)
    assert track.response is not None
    track.response.deleted = True
    state.engine.cancel(track.request_id)            # a running one stops
    return JSONResponse({"id": track.request_id, "object": "response", "deleted": True})


ROUTES = [Route("/v1/responses", create, methods=["POST"]),
          Route("/v1/responses/{response_id}", retrieve, methods=["GET"]),
          Route("/v1/responses/{response_id}", delete, methods=["DELETE"]),
          Route("/v1/responses/{response_id}/cancel", cancel, methods=["POST"])]
