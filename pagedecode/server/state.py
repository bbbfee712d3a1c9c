"""The server's state over one AsyncEngine: its options, the tenants, the Tracks of the requests
it started (tracks.py), the Idempotency-Key store, admission (body, model, grammar, queue room)
and what happens to a request whose client went away (its disconnect policy). Every request is
metered (metering.py) exactly once, when its terminal event is first seen, whoever sees it: the
client's handler, a resumed stream, or the watcher that follows a detached request to its end.
"""
from __future__ import annotations

import asyncio
import time
import weakref
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Mapping

from starlette.requests import ClientDisconnect, Request

from ..errors import InvalidRequestError
from ..model.tokenizer import EscapesSpecialTokens
from ..runtime.async_engine import AsyncEngine
from ..runtime.events import DeltaEvent, Event, TerminalEvent
from ..runtime.lifecycle import FinishReason
from . import jsonbody
from .chat import ChatTemplate
from .errors import ApiError
from .idempotency import IdempotencyKeys
from .metering import log_record, observe
from .metrics import Metrics
from .protocol import Limits, Parsed, Prompt, invalid
from .tenants import Tenants
from .tracks import Reply, Track

if TYPE_CHECKING:
    from .responses_input import StoredResponse


@dataclass
class ServerOptions:
    model_name: str
    api_key: str | None = None                  # one tenant's key; api_keys: more tenants
    api_keys: tuple[str, ...] = ()
    metrics_public: bool = False                # /metrics without a key even when keys are set
    allowed_hosts: tuple[str, ...] = ()         # Host names answered besides the address itself (guard.py)
    allow_special_tokens_in_content: bool = False   # chat content's "</s>" is the real token (unsafe)
    limits: Limits = field(default_factory=Limits)
    max_queued_requests: int = 256
    max_prompts_per_request: int = 64           # a completions batch's prompts (400 naming prompt beyond)
    max_body_bytes: int = 1 << 20
    generation_defaults: Mapping[str, Any] = field(default_factory=dict)
    log_text: bool = False
    resume_grace_s: float = 0.0
    on_disconnect: str = "cancel"
    idempotency_ttl_s: float = 600.0
    idempotency_max_keys: int = 10_000
    metrics_compat: str | None = None           # "vllm": the gateway gauges under vLLM's names too (metrics.py)
    response_id_prefix: str = "resp_"           # Responses API ids: this and 128 random bits (a Ray replica's
                                                # names it, as its engine's request_id_prefix does)


class ServerState:
    def __init__(self, async_engine: AsyncEngine, chat_template: ChatTemplate | None, options: ServerOptions) -> None:
        self.async_engine = async_engine
        self.engine = async_engine.engine
        self.chat_template = chat_template
        self.options = options
        self.metrics = Metrics(self.engine.snapshot, options.metrics_compat, options.model_name)
        self.draining = False
        self.tracks: weakref.WeakValueDictionary[str, Track] = weakref.WeakValueDictionary()
        self.keys = IdempotencyKeys(options.idempotency_ttl_s, options.idempotency_max_keys)
        self.tenants = Tenants(list(options.api_keys) + ([options.api_key] if options.api_key is not None else []))
        tok = self.engine.tokenizer
        if chat_template is not None and not options.allow_special_tokens_in_content \
                and isinstance(tok, EscapesSpecialTokens):
            tok.escape_specials("")       # builds the escape (a tokenizer copy) now, not during a request

    @property
    def serving(self) -> bool:
        """Admitting requests: started, and not draining."""
        return not self.draining and self.async_engine.running

    # -- admission -------------------------------------------------------------------------
    def check_metrics_auth(self, request: Request) -> None:
        if not self.options.metrics_public:
            self.tenants.check(request)

    def owned(self, tenant: str, request_id: str) -> Track:
        """The tenant's request; 404 for one it did not start (another tenant's is unknown too)."""
        track = self.tracks.get(request_id)
        if track is None or track.tenant != tenant or (track.response is not None and track.response.deleted):
            raise ApiError(404, f"unknown request id {request_id!r}", param="request_id", code="request_not_found")
        return track

    def check_model(self, body: object) -> None:
        """404 for a body that names another model (no model field: this one)."""
        name = self.options.model_name
        if isinstance(body, dict) and body.get("model") not in (None, name):
            raise ApiError(404, f"model {body.get('model')!r} is not served here (try {name!r})",
                           param="model", code="model_not_found")

    async def read_body(self, request: Request) -> tuple[Any, bytes]:
        """The request's JSON body (jsonbody.py's checks) and its bytes; 413 past max_body_bytes."""
        most = self.options.max_body_bytes
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
        return jsonbody.load(bytes(data)), bytes(data)

    async def prepare_grammar(self, parsed: Parsed, body: Mapping[str, Any]) -> None:
        """A constrained request's limits are checked and its grammar parsed in the engine's
        grammar worker, awaited here: the event loop and the step loop go on meanwhile, and an
        invalid grammar is still a 400 naming the field."""
        if parsed.params.structured_output is None:
            return
        param = "response_format" if body.get("response_format") is not None else "structured_outputs"
        timeout = self.engine.config.grammar_compile_timeout_s
        try:
            job = self.engine.prepare_grammar(parsed.params)
            assert job is not None
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(job.parsed)), timeout)
        except InvalidRequestError as e:
            raise ApiError(400, str(e), param=param, code="invalid_value") from None
        except asyncio.TimeoutError:
            raise ApiError(400, f"parsing the grammar took longer than grammar_compile_timeout_s={timeout}s",
                           param=param, code="invalid_value") from None

    def admit(self, count: int = 1) -> None:
        """Room for `count` more requests (a batch's prompts x n) in the queue, or 503 / 429: 429
        when the queue is full or the batch would overfill it (one larger than the whole queue goes
        when the queue is empty, never waits forever)."""
        if not self.serving:
            raise ApiError(503, "the server is starting or shutting down", headers={"Retry-After": "1"})
        waiting = self.engine.snapshot().waiting
        cap = self.options.max_queued_requests
        if waiting >= cap or waiting > 0 and waiting + count > cap:
            raise ApiError(429, f"{waiting} requests are already waiting", code="queue_full",
                           headers={"Retry-After": "1"})

    def prompts_of(self, parsed: Parsed) -> list[Prompt]:
        """The request's prompts: a completions batch's, or the one a chat's messages render to."""
        if parsed.messages is None:
            assert parsed.prompts
            return parsed.prompts
        if self.chat_template is None:
            raise ApiError(400, "this model has no chat template (start the server with --chat-template FILE)",
                           param="messages")
        tok = self.engine.tokenizer
        if self.options.allow_special_tokens_in_content or not isinstance(tok, EscapesSpecialTokens):
            return [tok.encode(self.chat_template.render(parsed.messages), add_special_tokens=False)]
        return [tok.encode_escaped(self.chat_template.render(parsed.messages, escape=tok.escape_specials))]

    def start(self, prompts: list[Prompt], parsed: Parsed, chat: bool, tenant: str,
              request_id: str | None = None, response: StoredResponse | None = None) -> list[Track]:
        """n independent requests per prompt, each with its Track, prompt-major (prompt i, sample j
        is tracks[i * n + j]), each pinned until its handler has sent it. Sample j is seeded
        seed + j whatever its prompt, so each prompt's choices are what a request for that prompt
        alone would get. request_id and response (a /v1/responses request: one prompt, n 1) name
        the request and keep its fields."""
        tracks: list[Track] = []
        try:
            for prompt in prompts:
                reply = self._reply(parsed, prompt)
                for j in range(parsed.n):
                    params = parsed.params
                    if parsed.n > 1 and params.seed is not None:
                        params = replace(params, seed=params.seed + j)
                    track = Track("", time.perf_counter(), chat, reply, tenant, response=response)
                    track.request_id = self.engine.add_request(prompt, params, request_id=request_id, acked=True,
                                                                 attachment=track, pinned=True)
                    self.tracks[track.request_id] = track
                    tracks.append(track)
        except InvalidRequestError as e:
            for t in tracks:
                self.engine.cancel(t.request_id)
                self.engine.unpin(t.request_id)
            raise invalid(e, parsed.fields) from None
        return tracks

    def _reply(self, parsed: Parsed, prompt: Prompt) -> Reply:
        reply = Reply.of(parsed)
        if not parsed.echo:
            return reply
        # a string prompt comes back as given, ids as their text
        return replace(reply, echo=prompt if isinstance(prompt, str) else self.engine.tokenizer.decode(prompt, True))

    # -- events, disconnects, metering --------------------------------------------------------
    def seen(self, track: Track, ev: Event) -> None:
        if isinstance(ev, DeltaEvent):
            t = time.perf_counter()
            if track.first_token is None:
                track.first_token = t
            elif track.last_delta is not None:
                self.metrics.itl.observe(t - track.last_delta)
            track.last_delta = t
        elif isinstance(ev, TerminalEvent):
            self.meter(track)

    def detached(self, track: Track, policy: str | None = None) -> None:
        """The last client reading the request went away before its end."""
        track.disconnects += 1
        if track.attached > 0:
            return
        policy = policy or track.reply.on_disconnect or self.options.on_disconnect
        grace = self.options.resume_grace_s
        if policy != "continue" and grace <= 0:
            self.engine.cancel(track.request_id, reason=FinishReason.TRANSPORT_ERROR)
        elif policy != "continue":
            async def cancel_later() -> None:
                await asyncio.sleep(grace)
                if track.attached == 0:
                    self.engine.cancel(track.request_id, reason=FinishReason.TRANSPORT_ERROR)
            track.grace_task = asyncio.ensure_future(cancel_later())
        self.watch(track)

    async def wait_all(self, request: Request, tracks: list[Track]) -> bool:
        """Follow every request to its end for a client waiting for one body; False when the
        client went away first (a disconnect of each request still running)."""
        async def collect(track: Track) -> None:
            async for ev in self.async_engine.follow(track.request_id, -1):
                self.seen(track, ev)
                self.engine.ack(track.request_id, ev.seq)
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
                    self.detached(t)
        if gone:
            return False
        for task in tasks:
            task.result()                 # a follower's failure is this request's
        return True

    def watch(self, track: Track) -> None:
        """Follow a request nobody reads to its end, so it is metered once."""
        async def watch() -> None:
            try:
                async for ev in self.async_engine.follow(track.request_id, -1):
                    if isinstance(ev, TerminalEvent):
                        self.meter(track)
            except KeyError:
                pass
        asyncio.ensure_future(watch())

    def meter(self, track: Track) -> None:
        """Count the request in the metrics and write its log line, once, when it has ended."""
        if track.metered:
            return
        try:
            out = self.engine.result(track.request_id)
        except KeyError:
            return
        if not out.state.terminal:
            return
        track.metered = True
        observe(self.metrics, track, out)
        log_record(track, out, self.options.model_name, self.options.log_text)


def state_of(request: Request) -> ServerState:
    """The ServerState of the app a request came to (build_app keeps it in app.state)."""
    state = request.app.state.pagedecode
    assert isinstance(state, ServerState)
    return state
