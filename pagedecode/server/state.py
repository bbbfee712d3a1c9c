"""The server's per-request bookkeeping: tenants (one per API key), Tracks (arrival, first
token, retries, resumes, attached clients), the Idempotency-Key store, disconnect policy and
metering.

A tenant is who holds one API key (without keys: the one anonymous tenant). A request's events,
trace and Idempotency-Keys belong to its tenant: another tenant is told they do not exist
(404, never 403), and Idempotency-Keys live apart per (tenant, endpoint).

Every request the server starts has a Track, kept with the engine's record of the request (its
attachment) and dropped with it: `tracks` maps ids to Tracks weakly, so the server keeps a Track
exactly as long as the engine keeps the request (within max_finished_kept / max_finished_bytes,
which count it), and never the request's body or messages. It is metered (metrics + one log
line) exactly once, when its terminal event is first seen, whoever sees it: the client's
handler, a resumed stream, or the watcher that follows a detached request to its end.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
import weakref
from collections import OrderedDict
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
from .metrics import Metrics
from .protocol import ApiError, Limits, Parsed, invalid

if TYPE_CHECKING:
    from .responses_api import StoredResponse

log = logging.getLogger("pagedecode.server")


ANONYMOUS = "anonymous"             # the tenant of a server without API keys


@dataclass(frozen=True)
class Reply:
    """What answering and metering a request needs from its body: never its messages, prompt or
    constraint (a body may be a megabyte)."""
    include_usage: bool
    logprobs: bool                    # the choices carry logprobs
    top_logprobs: int
    on_disconnect: str | None
    echo: str | None = None           # completions, echo: true: the prompt's text, put first
    prompt_logprobs: int | None = None   # vLLM's field: each choice carries prompt_logprobs

    @classmethod
    def of(cls, parsed: Parsed) -> "Reply":
        return cls(parsed.include_usage, parsed.params.logprobs is not None, parsed.top_logprobs,
                   parsed.on_disconnect, None, parsed.prompt_logprobs)


@dataclass
class Track:
    request_id: str
    arrival: float
    chat: bool
    reply: Reply
    tenant: str
    first_token: float | None = None
    last_delta: float | None = None
    attached: int = 0                 # clients reading it now
    retries: int = 0
    resumes: int = 0
    disconnects: int = 0
    metered: bool = False
    grace_task: asyncio.Task[None] | None = None
    created: int = field(default_factory=lambda: int(time.time()))   # OpenAI's `created`: one per request,
                                                                     # so a replay is byte-identical
    response: StoredResponse | None = None   # a /v1/responses request's own fields (responses_api.py)

    def kept_bytes(self) -> int:
        """What a Track adds to its finished request (tests/server/test_memory_http.py measures it)."""
        return TRACK_BYTES + (self.response.kept_bytes() if self.response is not None else 0) + (
            len(self.reply.echo) if self.reply.echo is not None else 0)


TRACK_BYTES = 500          # the Track (~320 bytes) and its entry in `tracks`


@dataclass
class IdempotencyEntry:
    body_hash: str
    request_ids: list[str]
    created: float


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


class ServerState:
    def __init__(self, ae: AsyncEngine, chat_template: ChatTemplate | None, options: ServerOptions) -> None:
        self.ae = ae
        self.engine = ae.engine
        self.chat_template = chat_template
        self.o = options
        self.metrics = Metrics(self.engine.snapshot)
        self.draining = False
        self.tracks: weakref.WeakValueDictionary[str, Track] = weakref.WeakValueDictionary()
        self.keys: OrderedDict[tuple[str, str, str], IdempotencyEntry] = OrderedDict()  # (tenant, endpoint, key)
        self._tenants = tenants(options)
        tok = self.engine.tokenizer
        if chat_template is not None and not options.allow_special_tokens_in_content \
                and isinstance(tok, EscapesSpecialTokens):
            tok.escape_specials("")       # builds the escape (a tokenizer copy) now, not during a request

    # -- admission -------------------------------------------------------------------------
    def check_auth(self, request: Request) -> str:
        """The tenant whose key the request carries (ANONYMOUS on a server without keys); 401
        otherwise. Every key is compared, each in constant time."""
        if not self._tenants:
            return ANONYMOUS
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # the scheme is case-insensitive (RFC 7235: "bearer" is "Bearer")
        given = token.strip().encode() if scheme.lower() == "bearer" else b""
        found: str | None = None
        for expected, tenant in self._tenants:
            if hmac.compare_digest(given, expected):
                found = tenant
        if found is None:
            raise ApiError(401, "invalid or missing API key", code="invalid_api_key")
        return found

    def check_metrics_auth(self, request: Request) -> None:
        if not self.o.metrics_public:
            self.check_auth(request)

    def owned(self, tenant: str, request_id: str) -> Track:
        """The tenant's request; 404 for one it did not start (another tenant's is unknown too)."""
        track = self.tracks.get(request_id)
        if track is None or track.tenant != tenant or (track.response is not None and track.response.deleted):
            raise ApiError(404, f"unknown request id {request_id!r}", param="request_id", code="request_not_found")
        return track

    def check_model(self, body: Any) -> None:
        """404 for a body that names another model (no model field: this one)."""
        if isinstance(body, dict) and body.get("model") not in (None, self.o.model_name):
            raise ApiError(404, f"model {body.get('model')!r} is not served here (try {self.o.model_name!r})",
                           param="model", code="model_not_found")

    async def body(self, request: Request) -> tuple[Any, bytes]:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.o.max_body_bytes:
            raise ApiError(413, f"request body over {self.o.max_body_bytes} bytes")
        data = bytearray()
        try:
            async for chunk in request.stream():
                data += chunk
                if len(data) > self.o.max_body_bytes:
                    raise ApiError(413, f"request body over {self.o.max_body_bytes} bytes")
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
        if self.draining or not self.ae.running:
            raise ApiError(503, "the server is starting or shutting down", headers={"Retry-After": "1"})
        waiting = self.engine.snapshot().waiting
        cap = self.o.max_queued_requests
        if waiting >= cap or waiting > 0 and waiting + count > cap:
            raise ApiError(429, f"{waiting} requests are already waiting", code="queue_full",
                           headers={"Retry-After": "1"})

    def prompts_of(self, parsed: Parsed) -> list[str | list[int]]:
        """The request's prompts: a completions batch's, or the one a chat's messages render to."""
        if parsed.messages is None:
            assert parsed.prompts
            return parsed.prompts
        if self.chat_template is None:
            raise ApiError(400, "this model has no chat template (start the server with --chat-template FILE)",
                           param="messages")
        tok = self.engine.tokenizer
        if self.o.allow_special_tokens_in_content or not isinstance(tok, EscapesSpecialTokens):
            return [tok.encode(self.chat_template.render(parsed.messages), add_special_tokens=False)]
        return [tok.encode_escaped(self.chat_template.render(parsed.messages, escape=tok.escape_specials))]

    def start(self, prompts: list[str | list[int]], parsed: Parsed, chat: bool, tenant: str,
              request_id: str | None = None, response: StoredResponse | None = None) -> list[Track]:
        """n independent requests per prompt, each with its Track, prompt-major (prompt i, sample j
        is tracks[i * n + j]). Sample j is seeded seed + j whatever its prompt, so each prompt's
        choices are what a request for that prompt alone would get. request_id and response (a
        /v1/responses request: one prompt, n 1) name the request and keep its fields."""
        tracks: list[Track] = []
        shape = Reply.of(parsed)
        try:
            for prompt in prompts:
                reply = shape
                if parsed.echo:        # a string prompt comes back as given, ids as their text
                    text = prompt if isinstance(prompt, str) else self.engine.tokenizer.decode(prompt, True)
                    reply = replace(shape, echo=text)
                for j in range(parsed.n):
                    params = parsed.params
                    if parsed.n > 1 and params.seed is not None:
                        params = replace(params, seed=params.seed + j)
                    track = Track("", time.perf_counter(), chat, reply, tenant, response=response)
                    track.request_id = self.engine.add_request(prompt, params, request_id=request_id, acked=True,
                                                                 attachment=track,
                                                                 pinned=True)  # until its handler has sent it
                    self.tracks[track.request_id] = track
                    tracks.append(track)
        except InvalidRequestError as e:
            for t in tracks:
                self.engine.cancel(t.request_id)
                self.engine.unpin(t.request_id)
            raise invalid(e, parsed.fields) from None
        return tracks

    # -- idempotency -------------------------------------------------------------------------
    def idempotent(self, key: tuple[str, str, str] | None, raw: bytes) -> IdempotencyEntry | None:
        """The entry a retry attaches to; 409 for the same key with another body. A key is
        (tenant, endpoint, Idempotency-Key): tenants and endpoints never see each other's."""
        if key is None:
            return None
        now_s = time.monotonic()
        while self.keys and (len(self.keys) > self.o.idempotency_max_keys
                             or now_s - next(iter(self.keys.values())).created > self.o.idempotency_ttl_s):
            self.keys.popitem(last=False)
        entry = self.keys.get(key)
        if entry is None:
            return None
        if entry.body_hash != hashlib.sha256(raw).hexdigest():
            raise ApiError(409, "this Idempotency-Key was used with a different request body",
                           code="idempotency_key_reused")
        return entry

    def remember(self, key: tuple[str, str, str] | None, raw: bytes, tracks: list[Track]) -> None:
        if key is not None:
            self.keys[key] = IdempotencyEntry(hashlib.sha256(raw).hexdigest(), [t.request_id for t in tracks],
                                              time.monotonic())

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

    def detached(self, track: Track, policy: str | None) -> None:
        """The last client reading the request went away before its end."""
        track.disconnects += 1
        if track.attached > 0:
            return
        policy = policy or track.reply.on_disconnect or self.o.on_disconnect
        if policy == "continue":
            self._watch(track)
            return
        grace = self.o.resume_grace_s
        if grace <= 0:
            self.engine.cancel(track.request_id, reason=FinishReason.TRANSPORT_ERROR)
            self._watch(track)
            return

        async def cancel_later() -> None:
            await asyncio.sleep(grace)
            if track.attached == 0:
                self.engine.cancel(track.request_id, reason=FinishReason.TRANSPORT_ERROR)
        track.grace_task = asyncio.ensure_future(cancel_later())
        self._watch(track)

    def _watch(self, track: Track) -> None:
        """Follow a request nobody reads to its end, so it is metered once."""
        async def watch() -> None:
            try:
                async for ev in self.ae.follow(track.request_id, -1):
                    if isinstance(ev, TerminalEvent):
                        self.meter(track)
            except KeyError:
                pass
        asyncio.ensure_future(watch())

    def meter(self, track: Track) -> None:
        if track.metered:
            return
        try:
            out = self.engine.result(track.request_id)
        except KeyError:
            return
        if not out.state.terminal:
            return
        track.metered = True
        m = self.metrics
        u = out.usage
        m.prompt_tokens.inc(u.prompt_tokens)
        m.generation_tokens.inc(u.returned_tokens)
        m.ended(out.finish_reason)
        m.e2e.observe(time.perf_counter() - track.arrival)
        m.queue.observe(out.timings.queue_s)
        m.prefill.observe(out.timings.prefill_s)
        m.decode.observe(out.timings.decode_s)
        if track.first_token is not None:
            m.ttft.observe(track.first_token - track.arrival)
        if track.disconnects:
            m.disconnects.inc()
        record: dict[str, Any] = {
            "request_id": out.request_id, "tenant": track.tenant, "model": self.o.model_name,
            "state": out.state.value,
            "finish_reason": out.finish_reason.value if out.finish_reason else None, "error": out.error,
            "prompt_tokens": u.prompt_tokens, "selected_tokens": u.selected_tokens,
            "processed_tokens": u.processed_tokens, "returned_tokens": u.returned_tokens,
            "queue_s": round(out.timings.queue_s, 6), "prefill_s": round(out.timings.prefill_s, 6),
            "decode_s": round(out.timings.decode_s, 6),
            "ttft_s": None if track.first_token is None else round(track.first_token - track.arrival, 6),
            "retries": track.retries, "resumes": track.resumes, "disconnects": track.disconnects}
        if self.o.log_text:
            record["text"] = out.text
        log.info("request %s", json.dumps(record))


def tenants(options: ServerOptions) -> list[tuple[bytes, str]]:
    """(a key's bytes, its tenant's name) for every key. A tenant is
    named by a digest of its key, so logs never hold a key."""
    keys = list(options.api_keys) + ([options.api_key] if options.api_key is not None else [])
    out: list[tuple[bytes, str]] = []
    for key in keys:
        if not key or key != key.strip():
            raise ValueError("an API key must be non-empty, without surrounding whitespace")
        name = "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]
        if all(n != name for _, n in out):
            out.append((key.encode(), name))
    return out
