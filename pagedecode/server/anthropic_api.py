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

from ..errors import InvalidRequestError
from ..runtime.output.events import DeltaEvent
from ..runtime.output.result import RequestOutput
from ..tools import ContentDelta, Delta, ToolOutput, ToolStreamParser
from .admission import Endpoint, Parsing, admit, check_model, prompts_of, read_body
from .anthropic_shapes import PING, MessageEvents, api_error, chat_request, error, message, sse
from .errors import ApiError
from .protocol import invalid, parse_request
from .reader import Reader
from .sse import ends_in_error
from .state import ServerOptions, state_of
from .tool_calls import call_ids, parsed_output
from .tracks import Track

TOOL_ID_PREFIX = "toolu_"


def parse(request: Request, body: Any, options: ServerOptions) -> Parsing:
    try:
        chat = chat_request(body)
    except InvalidRequestError as e:
        raise invalid(e, {}) from None
    parsed = parse_request(chat, True, options.generation_defaults, options.limits,
                           tool_format=state_of(request).tool_format)
    return Parsing(parsed, "tools")


MESSAGES = Endpoint("messages", chat=True, parse=parse, new_id=lambda options: "msg_" + secrets.token_hex(12))


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(api_error(e), status_code=e.status, headers=e.headers)


def output_of(track: Track, text: str) -> ToolOutput:
    fmt = track.reply.tool_format
    return ToolOutput(text) if fmt is None else parsed_output(text, fmt, track.request_id, TOOL_ID_PREFIX)


def stop_sequence(out: RequestOutput) -> str | None:
    return out.stop_reason if isinstance(out.stop_reason, str) else None


def reason(out: RequestOutput) -> str:
    return out.finish_reason.value if out.finish_reason is not None else "eos"


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
            return JSONResponse(error(500, out.error or "the request failed"), status_code=500, headers=headers)
        return JSONResponse(message(track.request_id, reader.model_name, output_of(track, out.text), reason(out),
                                    stop_sequence(out), out.usage.prompt_tokens, out.usage.returned_tokens),
                            headers=headers)


async def stream(reader: Reader, track: Track) -> AsyncIterator[str]:
    """Anthropic's events from the request's (a retry with the same Idempotency-Key replays them)."""
    async with reader:
        fmt = track.reply.tool_format
        parser = (ToolStreamParser(fmt, call_ids(track.request_id, TOOL_ID_PREFIX, fmt.id_length))
                  if fmt is not None else None)
        output = ToolOutput()               # what was sent (a request without tools: its text)

        def deltas(text: str | None) -> list[Delta]:
            """The parser's deltas for this text (None: the end); without tools, the text."""
            if parser is not None:
                return parser.feed(text) if text is not None else parser.finish()
            found: list[Delta] = [ContentDelta(text)] if text else []
            for d in found:
                output.apply(d)
            return found
        # the prompt's tokens are known once admitted
        events = MessageEvents(track.request_id, reader.model_name, reader.result(track).usage.prompt_tokens)
        yield "".join(map(sse, events.start() + [PING]))
        async for ev in reader.events(track):
            if isinstance(ev, DeltaEvent):
                frames = events.feed(deltas(ev.text))
                if frames:
                    yield "".join(map(sse, frames))
        out = reader.result(track)
        if ends_in_error(out):
            yield sse(error(500, out.error or "the request failed"))
            return
        last = events.feed(deltas(None))
        sent = parser.output if parser is not None else output
        yield "".join(map(sse, last + events.finish(reason(out), sent, stop_sequence(out), out.usage.returned_tokens)))


async def count_tokens(request: Request) -> Response:
    """The prompt's tokens as /v1/messages would render it (tools included); nothing runs."""
    state = state_of(request)
    try:
        state.tenants.check(request)
        body, _ = await read_body(state, request)
        check_model(state, body)
        if isinstance(body, dict) and body.get("max_tokens") is None:
            body = {**body, "max_tokens": 1}            # count_tokens' body has none
        parsed = parse(request, body, state.options).parsed
        [prompt] = prompts_of(state, parsed)
    except ApiError as e:
        return error_response(e)
    return JSONResponse({"input_tokens": len(prompt)})


ROUTES = [Route("/v1/messages", messages, methods=["POST"]),
          Route("/v1/messages/count_tokens", count_tokens, methods=["POST"])]
