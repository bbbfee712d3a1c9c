"""The ASGI app: OpenAI-compatible completions and chat (completions.py, sse.py) and the
Responses API (responses_api.py) over an AsyncEngine, keeping the request contract over HTTP:
ordered events with their sequence numbers as SSE ids, one terminal event, usage for every
ending, resumable streams, idempotent retries, two timeouts, admission control. A request is
let in by admission.py and read by reader.py; the server's state is state.py, each request's
record tracks.py; response shapes in openai_shapes.py.

Every handler is a module-level function that finds the server's state in `request.app.state`
(state_of) and raises ApiError for what it will not serve: the app answers it with OpenAI's
error body.
"""
from __future__ import annotations

from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import UnknownRequestError
from ..runtime.async_engine import AsyncEngine
from ..runtime.trace import to_chrome
from .anthropic_api import ROUTES as MESSAGES_ROUTES
from .chat import ChatTemplate
from .completions import chat_completions, completions
from .errors import ApiError
from .guard import RequestGuard
from .lora import ROUTES as LORA_ROUTES, load_modules
from .openai_shapes import id_headers, now
from .reader import Reader
from .responses_api import ROUTES as RESPONSES_ROUTES
from .sse import check_resume, last_event_id, one_sse
from .state import ServerOptions, ServerState, state_of
from .tokenize import ROUTES as TOKENIZE_ROUTES


async def health(request: Request) -> Response:
    if not state_of(request).serving:
        return JSONResponse({"status": "unavailable"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    state = state_of(request)
    state.check_metrics_auth(request)
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def events(request: Request) -> Response:
    """Replay a request's events after Last-Event-ID (or ?after=) and follow it live."""
    state = state_of(request)
    rid = request.path_params["request_id"]
    track = state.owned(state.tenants.check(request), rid)
    after = last_event_id(request)
    reader = Reader.pinning(state, [track], lambda e: ApiError(404, str(e), param="request_id",
                                                               code="request_not_found"))
    check_resume(reader, track, after)
    track.resumes += 1
    return StreamingResponse(one_sse(reader, track, after), media_type="text/event-stream",
                             headers={**id_headers(rid), "Cache-Control": "no-cache"})


async def trace(request: Request) -> Response:
    state = state_of(request)
    rid = request.path_params["request_id"]
    state.owned(state.tenants.check(request), rid)
    try:
        records = state.engine.trace(rid)
    except UnknownRequestError as e:
        raise ApiError(404, str(e), param="request_id", code="request_not_found") from None
    return JSONResponse(to_chrome({rid: records}, wall_offset_us=state.engine.wall_offset_us))


ROUTES = [
    Route("/health", health), *LORA_ROUTES, Route("/metrics", metrics),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/requests/{request_id}/events", events), Route("/v1/requests/{request_id}/trace", trace),
    *RESPONSES_ROUTES, *TOKENIZE_ROUTES, *MESSAGES_ROUTES,
]


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own answers (no such route 404, method not allowed 405, OPTIONS included:
    there is no CORS) in OpenAI's error body."""
    assert isinstance(exc, HTTPException)
    what = {404: f"no route {request.url.path}",
            405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return error_response(ApiError(exc.status_code, what, code=code, headers=exc.headers))


async def _server_error(request: Request, exc: Exception) -> Response:
    """A bug, never an answer to input: still OpenAI's body (the traceback goes to the log)."""
    return error_response(ApiError(500, "internal server error", code="internal_error"))


def build_app(async_engine: AsyncEngine, *, model_name: str | None = None, chat_template: ChatTemplate | None = None,
              **options: Any) -> Starlette:
    """The ASGI app over an AsyncEngine (started by the caller, or by `pagedecode serve`'s
    lifespan). options: the fields of ServerOptions (state.py: api_key / api_keys, metrics_public,
    allowed_hosts, allow_special_tokens_in_content, limits, max_queued_requests,
    max_prompts_per_request, max_body_bytes, generation_defaults, log_text, resume_grace_s,
    on_disconnect, idempotency_ttl_s, idempotency_max_keys, ...)."""
    state = ServerState(async_engine, chat_template,
                        ServerOptions(model_name=model_name or async_engine.engine.model_name, **options))
    app = Starlette(middleware=[Middleware(RequestGuard, allowed_hosts=state.options.allowed_hosts)], routes=ROUTES,
                    exception_handlers={ApiError: _api_error, HTTPException: _http_error, 500: _server_error})
    load_modules(state.engine, state.options.lora_modules)     # --lora-modules: a bad one stops the start, naming it
    app.state.pagedecode = state
    return app
