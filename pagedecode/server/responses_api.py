"""The Responses API: POST /v1/responses, GET / DELETE /v1/responses/{id}, POST .../cancel.

The body becomes a chat body (responses_input.py); the response runs as one engine request
whose id is the response id (`resp_` and 128 random bits) with its Track: its tenant owns it
(others get 404), pins keep it until it is sent, and it lives as long as the engine keeps its
record (the finished-request budget). Its object and its event stream: responses_output.py.
"""
from __future__ import annotations

import secrets
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import UnknownRequestError
from ..runtime.output.result import RequestOutput
from .admission import Endpoint, Parsing, admit
from .integers import parse_decimal
from .errors import ApiError, bad
from .reader import Reader, served_name
from .openai_shapes import id_headers
from .responses_input import parse_body, renamed
from .responses_output import response_body, response_sse, status_of
from .state import ServerOptions, ServerState, state_of
from .tracks import Track


def parse(request: Request, body: Any, options: ServerOptions) -> Parsing:
    parsed, meta = parse_body(body, options.generation_defaults, options.limits, state_of(request).tool_format)
    return Parsing(parsed, "tools" if parsed.tool_format is not None else "response_format", response=meta,
                   flat_tools=True)


# no Idempotency-Key (OpenAI's Responses API has none); the response id is ours, made here
RESPONSES = Endpoint("responses", chat=True, parse=parse, idempotent=False,
                     new_id=lambda options: options.response_id_prefix + secrets.token_hex(16))


def not_found(rid: str) -> ApiError:
    return ApiError(404, f"no response with id {rid!r}", param="response_id", code="response_not_found")


def stored(request: Request) -> tuple[ServerState, Track]:
    """The tenant's stored response named in the path; 404 for another tenant's, one made with
    store: false, a deleted one, or one the engine no longer keeps."""
    state = state_of(request)
    rid = request.path_params["response_id"]
    track = state.tracks.get(rid)
    if track is None or track.tenant != state.tenants.check(request) or track.response is None \
            or not track.response.store or track.response.deleted:
        raise not_found(rid)
    return state, track


def answer(track: Track, out: RequestOutput, model_name: str, headers: dict[str, str] | None = None
           ) -> JSONResponse:
    return JSONResponse(response_body(track, model_name, status_of(out), out), headers=headers)


async def create(request: Request) -> Response:
    try:
        admitted = await admit(state_of(request), request, RESPONSES)
    except ApiError as e:
        raise renamed(e) from None              # errors name the Responses fields
    reader = admitted.reader
    [track] = reader.tracks
    assert track.response is not None
    headers = id_headers(track.request_id)
    if track.response.background:
        reader.let_run(track)                   # nobody has to read it for it to run on
    if admitted.parsing.parsed.sse:
        return StreamingResponse(response_sse(reader, track, None), media_type="text/event-stream",
                                 headers={**headers, "Cache-Control": "no-cache"})
    if track.response.background:               # answered at once, queued or in progress
        try:
            return answer(track, reader.result(track), reader.model_name, headers)
        finally:
            reader.release()
    async with reader:
        if not await reader.wait_all(request):
            return Response(status_code=499)
        return answer(track, reader.result(track), reader.model_name, headers)


def starting_after(request: Request) -> int | None:
    """?starting_after=N: the stream resumes after event N (None, or -1: from the start)."""
    value = request.query_params.get("starting_after")
    if value is None:
        return None
    after = parse_decimal(value)
    if after is None or after < -1:
        raise bad("starting_after", f"must be a sequence number (an integer >= -1), got {value!r}")
    return None if after == -1 else after


async def retrieve(request: Request) -> Response:
    state, track = stored(request)
    if request.query_params.get("stream", "false").lower() not in ("true", "1"):
        try:
            return answer(track, state.engine.result(track.request_id), served_name(state, track))
        except UnknownRequestError:
            raise not_found(track.request_id) from None
    after = starting_after(request)
    reader = Reader.pinning(state, [track], lambda _: not_found(track.request_id))
    track.resumes += 1
    return StreamingResponse(response_sse(reader, track, after), media_type="text/event-stream",
                             headers={**id_headers(track.request_id), "Cache-Control": "no-cache"})


async def cancel(request: Request) -> Response:
    state, track = stored(request)
    assert track.response is not None
    if not track.response.background:
        raise ApiError(400, "only responses created with background: true can be cancelled",
                       param="response_id", code="invalid_value")
    async with Reader.pinning(state, [track], lambda _: not_found(track.request_id)) as reader:
        state.engine.cancel(track.request_id)
        async for _ in reader.events(track):     # to its terminal event: the cancel is effective
            pass
        return answer(track, reader.result(track), reader.model_name)


async def delete(request: Request) -> Response:
    state, track = stored(request)
    assert track.response is not None
    track.response.deleted = True
    state.engine.cancel(track.request_id)            # a running one stops
    return JSONResponse({"id": track.request_id, "object": "response", "deleted": True})


ROUTES = [Route("/v1/responses", create, methods=["POST"]),
          Route("/v1/responses/{response_id}", retrieve, methods=["GET"]),
          Route("/v1/responses/{response_id}", delete, methods=["DELETE"]),
          Route("/v1/responses/{response_id}/cancel", cancel, methods=["POST"])]
