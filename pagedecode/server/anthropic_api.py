"""The Anthropic Messages API: POST /v1/messages and /v1/messages/count_tokens.

A request is admitted like every other (admission.py: the tenant, by `x-api-key` or Bearer,
the body, the model, its parse step anthropic_shapes.chat_body -> parse_request, the tools'
grammar, Idempotency-Key, room), runs as one engine request named `msg_...`, and is read
through its Reader (the disconnect policy, metering). Its answer is a message of content blocks
or Anthropic's event stream:

    message_start, ping, (content_block_start, content_block_delta*, content_block_stop)*,
    message_delta (stop_reason, stop_sequence, usage.output_tokens), message_stop

and every error is Anthropic's shape ({"type": "error", "error": {"type", "message"}}).
"""
from __future__ import annotations

import secrets
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..runtime.events import DeltaEvent
from ..tools import ContentDelta, Delta, ToolOutput, ToolStreamParser
from .admission import Endpoint, Parsing, admit, check_model, prompts_of, read_body
from .anthropic_shapes import (BlockEvents, chat_body, error_body, event, message_body, renamed, stop_of,
                               usage_of)
from .errors import ApiError
from .protocol import parse_request
from .reader import Reader
from .sse import ends_in_error
from .state import ServerOptions, state_of
from .tool_calls import call_ids, parsed_output
from .tracks import Track

TOOL_ID_PREFIX = "toolu_"


def parse(request: Request, body: Any, options: ServerOptions, count_only: bool = False) -> Parsing:
    parsed = parse_request(chat_body(body, count_only), True, options.generation_defaults, options.limits,
                           tool_format=state_of(request).tool_format)
    return Parsing(parsed, "tools")


MESSAGES = Endpoint("messages", chat=True, parse=parse, new_id=lambda options: "msg_" + secrets.token_hex(12))


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(error_body(renamed(e)), status_code=e.status, headers=e.headers)


def output_of(track: Track, text: str) -> ToolOutput:
    fmt = track.reply.tool_format
    return ToolOutput(text) if fmt is None else parsed_output(text, fmt, track.request_id, TOOL_ID_PREFIX)


async def messages(request: Request) -> Response:
    try:
        admitted = await admit(state_of(request), request, MESSAGES)
    except ApiError as e:
        return error_response(e)
    reader = admitted.reader
    [track] = reader.tracks
    headers = {"X-Request-Id": track.request_id, "request-id": track.request_id}
    if admitted.parsing.parsed.sse:
        return StreamingResponse(stream(reader, track), media_type="text/event-stream",
                                 headers={**headers, "Cache-Control": "no-cache"})
    async with reader:
        if not await reader.wait_all(request):
            return Response(status_code=499)
        out = reader.result(track)
        if ends_in_error(out):
            return JSONResponse({"type": "error", "error": {"type": "api_error", "message": out.error}},
                                status_code=500, headers=headers)
        return JSONResponse(message_body(track.request_id, reader.model_name, output_of(track, out.text), out),
                            headers=headers)


async def stream(reader: Reader, track: Track) -> AsyncIterator[str]:
    """Anthropic's events from the request's (a retry with the same Idempotency-Key replays them)."""
    async with reader:
        fmt = track.reply.tool_format
        parser = ToolStreamParser(fmt, call_ids(track.request_id, TOOL_ID_PREFIX)) if fmt is not None else None
        blocks, output = BlockEvents(), ToolOutput()

        def deltas(text: str | None) -> list[Delta]:
            if parser is None:
                return [ContentDelta(text)] if text else []
            found = parser.feed(text) if text is not None else parser.finish()
            return found
        sent_start = False
        async for ev in reader.events(track):
            if not sent_start:
                yield opening(reader, track)
                sent_start = True
            if isinstance(ev, DeltaEvent):
                found = deltas(ev.text)
                for d in found:
                    output.apply(d)
                frames = blocks.frames(found)
                if frames:
                    yield "".join(frames)
        out = reader.result(track)
        if not sent_start:
            yield opening(reader, track)
        if ends_in_error(out):
            yield event("error", {"error": {"type": "api_error", "message": out.error}})
            return
        found = deltas(None)
        for d in found:
            output.apply(d)
        stop_reason, stop_sequence = stop_of(out, parser.output if parser is not None else output)
        yield "".join(blocks.frames(found) + blocks.stop()) + event("message_delta", {
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {"output_tokens": usage_of(out)["output_tokens"]}}) + event("message_stop", {})


def opening(reader: Reader, track: Track) -> str:
    """message_start (the prompt's tokens: known once the request was admitted) and a ping."""
    start: dict[str, Any] = {"id": track.request_id, "type": "message", "role": "assistant", "model": reader.model_name,
             "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": reader.result(track).usage.prompt_tokens, "output_tokens": 0}}
    return event("message_start", {"message": start}) + event("ping", {})


async def count_tokens(request: Request) -> Response:
    """The prompt's tokens as /v1/messages would render it (tools included); nothing runs."""
    state = state_of(request)
    try:
        state.tenants.check(request)
        body, _ = await read_body(state, request)
        check_model(state, body)
        parsed = parse(request, body, state.options, count_only=True).parsed
        [prompt] = prompts_of(state, parsed)
    except ApiError as e:
        return error_response(e)
    return JSONResponse({"input_tokens": len(prompt)})


ROUTES = [Route("/v1/messages", messages, methods=["POST"]),
          Route("/v1/messages/count_tokens", count_tokens, methods=["POST"])]
