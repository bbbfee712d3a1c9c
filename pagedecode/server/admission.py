"""Admission: the one pipeline every endpoint's request goes through before anything is read.

    tenant    its API key names the tenant (401)
    body      at most max_body_bytes (413), JSON (jsonbody.py; 400)
    model     the body names this model, a loaded LoRA adapter (lora.py), or none (404)
    parse     the endpoint's own step: the body -> Parsing (400 naming the endpoint's field)
    grammar   a constrained request's grammar parsed in the engine's grammar worker (400)
    key       a retry with the same Idempotency-Key and body attaches to what the first try
              started (409 when that is no longer kept; the endpoint's own retry checks);
    room      otherwise, room in the queue for its requests (503 starting or draining, 429 full)
    start     the engine's requests, n per prompt, each with its Track, pinned

and hands back a Reader (reader.py) that holds those pins. An endpoint is an Endpoint (its
parse step, and what else sets it apart) and a renderer that reads the Reader: a new API
supplies those two and nothing more.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable

from starlette.requests import ClientDisconnect, Request

from ..errors import InvalidRequestError
from ..lora.request import LoRARequest
from . import jsonbody
from ..tools import check_grammars
from .chat import encode_chat
from .errors import ApiError
from .idempotency import IdempotencyEntry
from .lora import adapter_of
from .protocol import Parsed, Prompt, invalid
from .reader import Reader
from .state import ServerOptions, ServerState
from .tracks import Reply, Track

if TYPE_CHECKING:
    from .responses_input import StoredResponse


@dataclass(frozen=True)
class Parsing:
    """What an endpoint's parse step makes of a request."""
    parsed: Parsed
    grammar_param: str = "response_format"       # the field a grammar that does not parse is named by
    after: int | None = None                     # the event a retry's stream resumes after (Last-Event-ID)
    response: StoredResponse | None = None       # a /v1/responses request's own fields, kept with its Track
    flat_tools: bool = False                     # its tools are the Responses API's flat shape (errors' names)


@dataclass(frozen=True)
class Endpoint:
    name: str                                    # its Idempotency-Key namespace
    chat: bool                                   # its requests are chats (their answers' shapes)
    parse: Callable[[Request, Any, ServerOptions], Parsing]
    idempotent: bool = True                      # a retry with the same Idempotency-Key attaches
    check_retry: Callable[[Reader, Parsing], None] | None = None   # ApiError: its pins are released
    new_id: Callable[[ServerOptions], str] | None = None           # names its requests (None: the engine)


@dataclass
class Admitted:
    parsing: Parsing
    reader: Reader          # holds the requests (a pin each) until its exchange is done with them
    retried: bool           # attached to what an earlier try with the same Idempotency-Key started


async def admit(state: ServerState, request: Request, endpoint: Endpoint) -> Admitted:
    tenant = state.tenants.check(request)
    raw = await read_bytes(state, request)
    # the body's parse, the chat's render and the prompt's encoding take ~1 s per MiB: in a
    # worker thread, so /health and every stream go on meanwhile (cheap bounds refuse first)
    body = await asyncio.to_thread(jsonbody.load, raw)
    lora = adapter_of(state.engine, state.options.model_name, body)
    parsing = await asyncio.to_thread(endpoint.parse, request, body, state.options)
    await prepare_grammar(state, parsing)
    header = request.headers.get("idempotency-key") if endpoint.idempotent else None
    key, entry = state.keys.lookup(header, tenant, endpoint.name, raw)
    if entry is not None:
        return Admitted(parsing, attach(state, entry, endpoint, parsing), retried=True)
    prompts = await asyncio.to_thread(prompts_of, state, parsing.parsed)
    check_room(state, len(prompts) * parsing.parsed.n)
    tracks = start(state, prompts, parsing, endpoint, tenant, lora)
    state.keys.remember(key, raw, [t.request_id for t in tracks])
    return Admitted(parsing, Reader(state, tracks), retried=False)


async def read_body(state: ServerState, request: Request) -> tuple[Any, bytes]:
    """The request's JSON body (jsonbody.py's checks) and its bytes; 413 past max_body_bytes."""
    raw = await read_bytes(state, request)
    return jsonbody.load(raw), raw


async def read_bytes(state: ServerState, request: Request) -> bytes:
    """The request's body; 413 past max_body_bytes."""
    most = state.options.max_body_bytes
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > most:
        raise ApiError(413, f"request body over {most} bytes")
    data = bytearray()
    try:
        async for chunk in request.stream():
            data += chunk
            if len(data) > most:
                raise ApiError(413, f"request body over {most} bytes")
    except ClientDisconnect:        # gone, or cut off by the body timeout: nothing was queued
        raise ApiError(408, "the client went away before sending the whole body") from None
    return bytes(data)


def check_model(state: ServerState, body: object) -> None:
    """404 for a body that names another model (no model field: this one); a LoRA adapter's
    name is this model too (lora.py)."""
    adapter_of(state.engine, state.options.model_name, body)


async def prepare_grammar(state: ServerState, parsing: Parsing) -> None:
    """A constrained request's limits are checked and its grammar parsed in the engine's grammar
    worker, awaited here: the event loop and the step loop go on meanwhile, and an invalid
    grammar is still a 400 naming the field."""
    params, param = parsing.parsed.params, parsing.grammar_param
    if params.structured_output is None:
        return
    timeout = state.engine.config.grammar_compile_timeout_s
    try:
        job = state.engine.prepare_grammar(params)
        assert job is not None
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(job.parsed)), timeout)
    except InvalidRequestError as e:
        raise name_tool(parsing, e) from None
    except asyncio.TimeoutError:
        raise ApiError(400, f"parsing the grammar took longer than grammar_compile_timeout_s={timeout}s",
                       param=param, code="invalid_value") from None


def name_tool(parsing: Parsing, e: InvalidRequestError) -> ApiError:
    """A grammar that does not parse, as a 400 naming the field: a tool-calling request's is
    one of its tools (each schema parsed alone finds which: only on this error path)."""
    tools = parsing.parsed.tools
    if tools is not None and tools.calls_possible:
        try:
            check_grammars(tools, flat=parsing.flat_tools)
        except InvalidRequestError as named:
            return invalid(named, {})
    return ApiError(400, str(e), param=parsing.grammar_param, code="invalid_value")


def attach(state: ServerState, entry: IdempotencyEntry, endpoint: Endpoint, parsing: Parsing) -> Reader:
    """A reader of the requests a retry's Idempotency-Key started."""
    tracks = [t for t in map(state.tracks.get, entry.request_ids) if t is not None]
    if len(tracks) != len(entry.request_ids):
        raise ApiError(409, "this Idempotency-Key's request is no longer kept", code="idempotency_expired")
    reader = Reader.pinning(state, tracks, lambda e: ApiError(409, str(e), param="request_id",
                                                              code="idempotency_expired"))
    if endpoint.check_retry is not None:
        try:
            endpoint.check_retry(reader, parsing)
        except ApiError:
            reader.release()
            raise
    for t in tracks:
        t.retries += 1
    state.metrics.replays.inc()
    return reader


def check_room(state: ServerState, count: int = 1) -> None:
    """Room for `count` more requests (a batch's prompts x n) in the queue, or 503 / 429: 429
    when the queue is full or the batch would overfill it (one larger than the whole queue goes
    when the queue is empty, never waits forever)."""
    if not state.serving:
        raise ApiError(503, "the server is starting or shutting down", headers={"Retry-After": "1"})
    waiting = state.engine.snapshot().waiting
    cap = state.options.max_queued_requests
    if waiting >= cap or waiting > 0 and waiting + count > cap:
        raise ApiError(429, f"{waiting} requests are already waiting", code="queue_full",
                       headers={"Retry-After": "1"})


def prompts_of(state: ServerState, parsed: Parsed) -> list[Prompt]:
    """The request's prompts: a completions batch's, or the one a chat's messages render to."""
    if parsed.messages is None:
        assert parsed.prompts
        return parsed.prompts
    if state.chat_template is None:
        raise ApiError(400, "this model has no chat template (start the server with --chat-template FILE)",
                       param="messages")
    return [encode_chat(state.engine.tokenizer, state.chat_template, parsed.messages,
                        state.options.allow_special_tokens_in_content, parsed.template_extra,
                        add_generation_prompt=parsed.add_generation_prompt, max_context=state.engine.max_context,
                        continue_final_message=parsed.continue_final_message)]


def start(state: ServerState, prompts: list[Prompt], parsing: Parsing, endpoint: Endpoint, tenant: str,
          lora: LoRARequest | None = None) -> list[Track]:
    """n independent requests per prompt, each with its Track, prompt-major (prompt i, sample j
    is tracks[i * n + j]), each pinned. Sample j is seeded seed + j whatever its prompt, so each
    prompt's choices are what a request for that prompt alone would get."""
    parsed, tracks = parsing.parsed, list[Track]()
    request_id = endpoint.new_id(state.options) if endpoint.new_id is not None else None
    try:
        for prompt in prompts:
            reply = reply_of(state, parsed, prompt)
            for j in range(parsed.n):
                params = parsed.params
                if parsed.n > 1 and params.seed is not None:
                    params = replace(params, seed=params.seed + j)
                track = Track("", time.perf_counter(), endpoint.chat, reply, tenant, response=parsing.response,
                              adapter=lora.name if lora is not None else None)
                track.request_id = state.engine.add_request(prompt, params, request_id=request_id, acked=True,
                                                            attachment=track, pinned=True, lora=lora)
                state.tracks[track.request_id] = track
                tracks.append(track)
    except InvalidRequestError as e:
        for t in tracks:
            state.engine.cancel(t.request_id)
            state.engine.unpin(t.request_id)
        raise invalid(e, parsed.fields) from None
    return tracks


def reply_of(state: ServerState, parsed: Parsed, prompt: Prompt) -> Reply:
    reply = Reply.of(parsed)
    if not parsed.echo:
        return reply
    # a string prompt comes back as given, ids as their text
    return replace(reply, echo=prompt if isinstance(prompt, str) else state.engine.tokenizer.decode(prompt, True))
