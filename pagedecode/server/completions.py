"""POST /v1/completions and /v1/chat/completions: admitted (admission.py: a new request, or a
retry attached to the ones its Idempotency-Key started), then answered as SSE (sse.py) or, once
every choice has ended, as one body."""
from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..runtime.output.result import RequestOutput
from ..tools import tool_finish_reason
from .admission import Endpoint, Parsing, admit
from .errors import ApiError
from .protocol import parse_request
from .reader import Reader
from .openai_shapes import (chat_choice, completion_choice, id_headers, echo_logprobs_body, logprobs_body, prompt_logprobs_body,
                        sum_usage)
from .sse import check_resume, choices_sse, last_event_id, one_sse
from .state import ServerOptions, state_of
from .tool_calls import message_body, parsed_output
from .tracks import Track

SSE_HEADERS = {"Cache-Control": "no-cache"}


def parse(request: Request, body: Any, options: ServerOptions, chat: bool) -> Parsing:
    parsed = parse_request(body, chat, options.generation_defaults, options.limits, options.max_prompts_per_request,
                           state_of(request).tool_format)
    grammar_param = "tools" if parsed.tool_format is not None else \
        "response_format" if body.get("response_format") is not None else "structured_outputs"
    return Parsing(parsed, grammar_param, after=last_event_id(request) if parsed.sse else None)


def check_retry(reader: Reader, parsing: Parsing) -> None:
    """A retry's stream resumes after its Last-Event-ID: one choice's only (several have no ids)."""
    if len(reader.tracks) > 1 and parsing.after is not None:
        raise ApiError(400, "a stream of several choices (a batch of prompts, or n > 1) has no event "
                            "ids to resume after: retry without Last-Event-ID (the same Idempotency-Key "
                            "replays it from the start)", param="Last-Event-ID", code="resume_not_supported")
    if parsing.parsed.sse and len(reader.tracks) == 1:
        check_resume(reader, reader.tracks[0], parsing.after)


CHAT = Endpoint("chat", chat=True, parse=lambda request, body, options: parse(request, body, options, True),
                check_retry=check_retry)
COMPLETIONS = Endpoint("completions", chat=False, check_retry=check_retry,
                       parse=lambda request, body, options: parse(request, body, options, False))


async def completions(request: Request) -> Response:
    return await generate(request, COMPLETIONS)


async def chat_completions(request: Request) -> Response:
    return await generate(request, CHAT)


async def generate(request: Request, endpoint: Endpoint) -> Response:
    admitted = await admit(state_of(request), request, endpoint)
    reader, parsed = admitted.reader, admitted.parsing.parsed
    tracks = reader.tracks
    headers = id_headers(tracks[0].request_id)
    if parsed.sse:
        after = admitted.parsing.after if admitted.retried else None   # a new request: nothing of it was seen
        frames = one_sse(reader, tracks[0], after) if len(tracks) == 1 else choices_sse(reader, parsed.n)
        return StreamingResponse(frames, media_type="text/event-stream", headers={**headers, **SSE_HEADERS})
    async with reader:          # wait for every choice; a client that goes away is a disconnect
        if not await reader.wait_all(request):
            return Response(status_code=499)
        outs = [reader.result(t) for t in tracks]
        return JSONResponse(completion_body(tracks, outs, parsed.n, reader.model_name, reader.tokenizer),
                            headers=headers)


def completion_body(tracks: list[Track], outs: list[RequestOutput], n: int, model_name: str, tokenizer: Any
                    ) -> dict[str, Any]:
    """The one body of a request whose choices have all ended."""
    chat, reply = tracks[0].chat, tracks[0].reply
    choices = []
    for i, out in enumerate(outs):
        text, echo = out.text, tracks[i].reply.echo
        if echo is not None:
            lps = echo_logprobs_body(tokenizer, out, reply.top_logprobs) if reply.logprobs else None
            text = echo + text
        else:
            lps = logprobs_body(tokenizer, out, chat, reply.top_logprobs) if reply.logprobs else None
        choices.append((chat_choice if chat else completion_choice)(i, out, text, lps))
        fmt = tracks[i].reply.tool_format
        if fmt is not None:             # the calls parsed out of the text, and the reason that agrees
            output = parsed_output(text, fmt, tracks[i].request_id)
            choices[-1]["message"] = message_body(output)
            choices[-1]["finish_reason"] = tool_finish_reason(output, choices[-1]["finish_reason"])
        if reply.prompt_logprobs is not None:
            choices[-1]["prompt_logprobs"] = prompt_logprobs_body(tokenizer, out)
    body: dict[str, Any] = {"id": tracks[0].request_id, "object": "chat.completion" if chat else "text_completion",
                            "created": tracks[0].created, "model": model_name, "choices": choices,
                            "usage": sum_usage(outs, n)}
    errors = [o.error for o in outs if o.error]
    if errors:
        body["pagedecode_error"] = errors[0]
    return body
