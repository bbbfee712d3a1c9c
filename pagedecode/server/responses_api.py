"""The Responses API: POST /v1/responses, GET / DELETE /v1/responses/{id}, POST .../cancel.

A body becomes a chat body (`instructions` a system message first, then `input`; text.format
as response_format; max_output_tokens as max_completion_tokens) that protocol.parse_request
parses, so sampling, limits, the chat template's escaping and structured output are the chat
path's. The response runs as one engine request whose id is the response id (`resp_` and 128
random bits) with its Track: its tenant owns it (others get 404), pins keep it until it is
sent, and it lives as long as the engine keeps its record (the finished-request budget).

The stream is a pure function of the request's engine events:

    engine event        response events (numbered 0, 1, ... in this order)
    start               response.created, response.in_progress, response.output_item.added,
                        response.content_part.added
    delta (with text)   response.output_text.delta
    terminal            response.output_text.done, response.content_part.done,
                        response.output_item.done, response.<completed|incomplete|failed|cancelled>

so a stream resumed after sequence number N (GET ?stream=true&starting_after=N) recomputes the
list from the request's history and sends what follows N, then follows it live: no gap, no
duplicate, whether the response is running or finished.
"""
from __future__ import annotations

import asyncio
import json
import secrets
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..runtime.events import DeltaEvent, Event, RequestOutput, StartEvent, TerminalEvent
from ..runtime.lifecycle import FinishReason, RequestState
from .protocol import ApiError, Parsed, _bool, bad, parse_request
from .state import ServerState, Track

# the request's fields under their chat names, for parse_request; errors name the Responses field
RENAMED = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}
# pagedecode's own extras, taken as on chat
PASSED = ("seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop",
          "timeout", "first_token_timeout", "on_disconnect", "ignore_eos", "min_tokens")
# taken and not acted on (a server without tools or tiers has nothing to do with them)
IGNORED = ("parallel_tool_calls", "user", "service_tier", "prompt_cache_key", "safety_identifier", "stream_options",
           "truncation")
UNSUPPORTED = {
    "tools": "tools are not supported by this server",
    "reasoning": "reasoning (and reasoning items) is not supported by this server",
    "previous_response_id": "previous_response_id is not supported: send the conversation as input messages",
    "conversation": "conversations are not supported: send the conversation as input messages",
    "prompt": "prompt templates are not supported",
    "include": "include is not supported",
    "top_logprobs": "top_logprobs is not supported on /v1/responses (use /v1/chat/completions)",
    "max_tool_calls": "tools are not supported by this server",
}
TAKEN = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "store",
         "background", "metadata", "text", "tool_choice", *PASSED, *IGNORED, *UNSUPPORTED}
INCOMPLETE = {FinishReason.MAX_OUTPUT_TOKENS: "max_output_tokens", FinishReason.CONTEXT_LIMIT: "max_output_tokens"}
STARTING = (RequestState.CREATED, RequestState.QUEUED)


@dataclass
class StoredResponse:
    """What a response object echoes besides its output, kept with its Track."""
    store: bool
    background: bool
    instructions: str | None
    metadata: dict[str, str]
    max_output_tokens: int | None
    temperature: float
    top_p: float
    tool_choice: str
    text: dict[str, Any] = field(default_factory=dict)
    deleted: bool = False

    def kept_bytes(self) -> int:
        return 300 + len(json.dumps([self.instructions, self.metadata, self.text]))


# -- parsing --------------------------------------------------------------------------------------
def parse_body(body: Any, state: ServerState) -> tuple[Parsed, StoredResponse]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name in body:
        if name not in TAKEN:
            raise ApiError(400, f"unknown parameter {name!r}", param=name, code="unknown_parameter")
    for name, why in UNSUPPORTED.items():
        if body.get(name) not in (None, [], {}, 0):
            raise ApiError(400, f"{name}: {why}", param=name, code="unsupported_parameter")
    if body.get("tool_choice") not in (None, "none", "auto"):
        raise ApiError(400, 'tool_choice: only "none" or "auto" (there are no tools here)', param="tool_choice",
                       code="unsupported_parameter")
    if body.get("truncation") not in (None, "disabled", "auto"):
        raise bad("truncation", 'must be "disabled" or "auto"')
    store = _bool(body, "store", True)
    background = _bool(body, "background")
    if background and not store:
        raise bad("background", "background responses need store: true (the result is fetched later)")
    chat: dict[str, Any] = {"messages": messages(body), "stream": body.get("stream"),
                            "max_completion_tokens": body.get("max_output_tokens"),
                            "response_format": text_format(body.get("text"))}
    for name in ("temperature", "top_p", *PASSED):
        if body.get(name) is not None:
            chat[name] = body[name]
    if background:
        chat["on_disconnect"] = "continue"      # it outlives the connection that made it
    try:
        parsed = parse_request({k: v for k, v in chat.items() if v is not None}, True,
                               state.o.generation_defaults, state.o.limits)
    except ApiError as e:
        raise renamed(e) from None
    p = parsed.params
    text: dict[str, Any] = body["text"] if isinstance(body.get("text"), dict) else {"format": {"type": "text"}}
    return parsed, StoredResponse(store, background, body.get("instructions"), metadata(body.get("metadata")),
                                  body.get("max_output_tokens"), p.temperature, p.top_p,
                                  body.get("tool_choice") or "auto", text)


def messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """`instructions` as a system message first, then `input` (a string: one user message)."""
    out: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad("instructions", "must be a string")
        out.append({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str) and given:
        return out + [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise bad("input", "must be a non-empty string or a non-empty list of messages")
    for i, item in enumerate(given):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(where, "must be a message object {role, content}")
        kind = item.get("type", "message")
        if kind != "message":
            raise ApiError(400, f"{where}.type: {kind!r} items are not supported (only messages)",
                           param=f"{where}.type", code="unsupported_parameter")
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise bad(f"{where}.role", f'must be "user", "assistant", "system" or "developer", got {role!r}')
        out.append({"role": "system" if role == "developer" else role,
                    "content": content_text(item.get("content"), where)})
    return out


def content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where}.content", "must be a string or a list of input_text / output_text parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text") and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif kind in ("input_image", "input_file", "input_audio", "refusal"):
            raise ApiError(400, f"{where}.content[{j}]: {kind} parts are not supported (text only)",
                           param=f"{where}.content[{j}]", code="unsupported_parameter")
        else:
            raise bad(f"{where}.content[{j}]", "must be an input_text or output_text part {type, text}")
    return "".join(parts)


def text_format(text: Any) -> dict[str, Any] | None:
    """text.format as chat's response_format."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad("text", "must be an object")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise bad("text.format", 'type must be "text", "json_object" or "json_schema"')
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    if not isinstance(fmt.get("schema"), (dict, bool)):
        raise bad("text.format.schema", "must be a JSON schema object")
    return {"type": "json_schema", "json_schema": {"schema": fmt["schema"], "name": fmt.get("name"),
                                                   "strict": fmt.get("strict")}}


def metadata(value: Any) -> dict[str, str]:
    """OpenAI's bounds: at most 16 pairs, keys up to 64 characters, values up to 512."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > 16 or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in value.items()):
        raise bad("metadata", "must be an object of at most 16 string values (keys <= 64, values <= 512 characters)")
    return dict(value)


def renamed(e: ApiError) -> ApiError:
    """An error of the chat path, naming the Responses field."""
    if e.param in RENAMED:
        old = e.param
        e.param = RENAMED[old]
        e.message = e.message.replace(old, e.param)
        if e.param not in e.message:
            e.message = f"{e.param}: {e.message}"
    return e


# -- response objects -----------------------------------------------------------------------------
def status_of(out: RequestOutput) -> str:
    if not out.state.terminal:
        return "queued" if out.state in STARTING else "in_progress"
    if out.state == RequestState.CANCELLED:
        return "cancelled"
    if out.finish_reason in INCOMPLETE:
        return "incomplete"
    if out.error or out.state == RequestState.FAILED:
        return "failed"
    if out.finish_reason in (FinishReason.EOS, FinishReason.STOP_SEQUENCE, FinishReason.GRAMMAR_COMPLETE):
        return "completed"
    return "incomplete"                   # ended early without an error (a deadline)


def message_item(rid: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": "msg_" + rid.removeprefix("resp_"), "status": status, "role": "assistant",
            "content": [output_text(text)]}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def item_status(status: str) -> str:
    return {"completed": "completed", "queued": "in_progress", "in_progress": "in_progress"}.get(status, "incomplete")


def response_body(state: ServerState, track: Track, status: str, out: RequestOutput | None) -> dict[str, Any]:
    """The response object: a snapshot without output (out None: the stream's opening events),
    or as the request stands (terminal: final, with usage)."""
    meta = track.response
    assert meta is not None
    rid = track.request_id
    output: list[dict[str, Any]] = []
    usage = error = incomplete = None
    if out is not None:
        if out.state.terminal or out.text:
            output.append(message_item(rid, out.text, item_status(status)))
        if out.state.terminal:
            u = out.usage
            usage = {"input_tokens": u.prompt_tokens,
                     "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
                     "output_tokens": u.returned_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": u.prompt_tokens + u.returned_tokens}
        if status == "failed":
            error = {"code": "server_error", "message": out.error or (out.finish_reason.value if out.finish_reason
                                                                      else "the response failed")}
        if status == "incomplete":
            incomplete = {"reason": INCOMPLETE.get(out.finish_reason) if out.finish_reason in INCOMPLETE
                          else (out.finish_reason.value if out.finish_reason else None)}
    return {"id": rid, "object": "response", "created_at": track.created, "status": status,
            "background": meta.background, "error": error, "incomplete_details": incomplete,
            "instructions": meta.instructions, "max_output_tokens": meta.max_output_tokens,
            "metadata": meta.metadata, "model": state.o.model_name, "output": output, "parallel_tool_calls": False,
            "previous_response_id": None, "reasoning": None, "store": meta.store, "temperature": meta.temperature,
            "text": meta.text, "tool_choice": meta.tool_choice, "tools": [], "top_p": meta.top_p,
            "truncation": "disabled", "usage": usage}


class StreamEvents:
    """The response events one engine event makes (see the module doc), without their numbers."""

    def __init__(self, state: ServerState, track: Track) -> None:
        self.state, self.track = state, track
        self.opened = False
        self.item_id = "msg_" + track.request_id.removeprefix("resp_")

    def of(self, ev: Event) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if not self.opened:
            self.opened = True
            events += self.opening()
        if isinstance(ev, DeltaEvent) and ev.text:
            events.append({"type": "response.output_text.delta", "item_id": self.item_id, "output_index": 0,
                           "content_index": 0, "delta": ev.text, "logprobs": []})
        elif isinstance(ev, TerminalEvent):
            events += self.closing()
        return events

    def opening(self) -> list[dict[str, Any]]:
        first = "queued" if self.track.response is not None and self.track.response.background else "in_progress"
        return [{"type": "response.created", "response": response_body(self.state, self.track, first, None)},
                {"type": "response.in_progress",
                 "response": response_body(self.state, self.track, "in_progress", None)},
                {"type": "response.output_item.added", "output_index": 0,
                 "item": {**message_item(self.track.request_id, "", "in_progress"), "content": []}},
                {"type": "response.content_part.added", "item_id": self.item_id, "output_index": 0,
                 "content_index": 0, "part": output_text("")}]

    def closing(self) -> list[dict[str, Any]]:
        out = self.state.engine.result(self.track.request_id)       # terminal: it no longer changes
        status = status_of(out)
        final = response_body(self.state, self.track, status, out)
        return [{"type": "response.output_text.done", "item_id": self.item_id, "output_index": 0,
                 "content_index": 0, "text": out.text, "logprobs": []},
                {"type": "response.content_part.done", "item_id": self.item_id, "output_index": 0,
                 "content_index": 0, "part": output_text(out.text)},
                {"type": "response.output_item.done", "output_index": 0, "item": final["output"][0]},
                {"type": f"response.{status}", "response": final}]


def frame(event: dict[str, Any], seq: int) -> str:
    data = {"type": event["type"], "sequence_number": seq, **event}
    return f"event: {event['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def stream(state: ServerState, track: Track, after: int) -> AsyncIterator[str]:
    """The response's events numbered after `after`, live to the end. Holds a pin (taken by the
    caller) until it ends; a client that goes away is a disconnect (its policy)."""
    rid = track.request_id
    track.attached += 1
    if track.grace_task is not None:          # resumed within the grace period
        track.grace_task.cancel()
        track.grace_task = None
    ended = False
    try:
        events, n = StreamEvents(state, track), 0
        async for ev in state.ae.follow(rid, -1):
            items = events.of(ev)
            if n + len(items) - 1 > after:       # some of them are new to this client
                state.seen(track, ev)
            for item in items:
                if n > after:
                    yield frame(item, n)
                n += 1
            state.engine.ack(rid, ev.seq)          # sent: the request may run on (backpressure)
            ended = isinstance(ev, TerminalEvent)
    finally:
        track.attached -= 1
        if not ended:
            state.detached(track, None)
        state.engine.unpin(rid)


async def wait_end(state: ServerState, request: Request, track: Track) -> bool:
    """Follow the request to its end; False when the client went away first (a disconnect)."""
    async def collect() -> None:
        async for ev in state.ae.follow(track.request_id, -1):
            state.seen(track, ev)
            state.engine.ack(track.request_id, ev.seq)
    track.attached += 1
    task = asyncio.ensure_future(collect())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.1)
            if not task.done() and await request.is_disconnected():
                break
    finally:
        track.attached -= 1
        if not task.done():
            task.cancel()
            state.detached(track, None)
            return False
    task.result()
    return True


# -- handlers -------------------------------------------------------------------------------------
def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def not_found(rid: str) -> ApiError:
    return ApiError(404, f"no response with id {rid!r}", param="response_id", code="response_not_found")


def stored(state: ServerState, request: Request) -> Track:
    """The tenant's stored response named in the path; 404 for another tenant's, one made with
    store: false, a deleted one, or one the engine no longer keeps."""
    rid = request.path_params["response_id"]
    track = state.tracks.get(rid)
    if track is None or track.tenant != state.check_auth(request) or track.response is None \
            or not track.response.store or track.response.deleted:
        raise not_found(rid)
    return track


def pinned(state: ServerState, track: Track) -> None:
    try:
        state.engine.pin(track.request_id)
    except KeyError:
        raise not_found(track.request_id) from None


def routes(state: ServerState) -> list[Route]:
    async def create(request: Request) -> Response:
        try:
            tenant = state.check_auth(request)
            body, _ = await state.body(request)
            state.check_model(body)
            parsed, meta = parse_body(body, state)
            await state.prepare_grammar(parsed, {"response_format": True})
            state.admit()
            [track] = state.start(state.prompts_of(parsed), parsed, True, tenant,
                                  request_id=f"resp_{secrets.token_hex(16)}", response=meta)      # pinned
        except ApiError as e:
            return _error(renamed(e))
        rid = track.request_id
        headers = {"X-Request-Id": rid}
        if meta.background:
            state.engine.detach_stream(rid)       # nobody has to read it for it to run on
            state._watch(track)                   # metered when it ends
        if parsed.stream:
            return StreamingResponse(stream(state, track, -1), media_type="text/event-stream",
                                     headers={**headers, "Cache-Control": "no-cache"})
        try:
            if not meta.background and not await wait_end(state, request, track):
                return Response(status_code=499)
            out = state.engine.result(rid)
            return JSONResponse(response_body(state, track, status_of(out), out), headers=headers)
        finally:
            state.engine.unpin(rid)

    async def retrieve(request: Request) -> Response:
        try:
            track = stored(state, request)
            if request.query_params.get("stream", "false").lower() not in ("true", "1"):
                try:
                    out = state.engine.result(track.request_id)
                except KeyError:
                    raise not_found(track.request_id) from None
                return JSONResponse(response_body(state, track, status_of(out), out))
            value = request.query_params.get("starting_after", "-1")
            try:
                after = int(value)
            except ValueError:
                after = -2
            if after < -1:
                raise bad("starting_after", f"must be a sequence number (an integer >= -1), got {value!r}")
            pinned(state, track)
            track.resumes += 1
        except ApiError as e:
            return _error(e)
        return StreamingResponse(stream(state, track, after), media_type="text/event-stream",
                                 headers={"X-Request-Id": track.request_id, "Cache-Control": "no-cache"})

    async def cancel(request: Request) -> Response:
        try:
            track = stored(state, request)
            assert track.response is not None
            if not track.response.background:
                raise ApiError(400, "only responses created with background: true can be cancelled",
                               param="response_id", code="invalid_value")
            pinned(state, track)
        except ApiError as e:
            return _error(e)
        rid = track.request_id
        try:
            state.engine.cancel(rid)
            async for _ in state.ae.follow(rid, -1):     # to its terminal event: the cancel is effective
                pass
            out = state.engine.result(rid)
            return JSONResponse(response_body(state, track, status_of(out), out))
        finally:
            state.engine.unpin(rid)

    async def delete(request: Request) -> Response:
        try:
            track = stored(state, request)
        except ApiError as e:
            return _error(e)
        assert track.response is not None
        track.response.deleted = True
        state.engine.cancel(track.request_id)            # a running one stops
        return JSONResponse({"id": track.request_id, "object": "response", "deleted": True})

    return [Route("/v1/responses", create, methods=["POST"]),
            Route("/v1/responses/{response_id}", retrieve, methods=["GET"]),
            Route("/v1/responses/{response_id}", delete, methods=["DELETE"]),
            Route("/v1/responses/{response_id}/cancel", cancel, methods=["POST"])]
