"""The router: which replica answers a request (see pagedecode/ray/__init__.py for the rules)."""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, AsyncIterator

from ..runtime.prefix_cache import namespace, page_key
from .ring import Ring

if TYPE_CHECKING:
    from .app import Spec

log = logging.getLogger("pagedecode.ray")

REPLICA_HEADER = "x-pagedecode-replica"
INDEX_KEYS = 200_000             # page keys the router remembers per replica (LRU)
PROBE_S = 0.5                    # how often a replica marked down is probed
PROMPTED = ("/v1/completions", "/v1/chat/completions")   # routed by their prompt's prefix
ID_TAG = re.compile(r"^(?:req-|resp_)r(\d+)-")     # a replica's request and response ids


def _failure_types() -> tuple[type[BaseException], ...]:
    from ray import exceptions as rx
    return tuple(t for t in (getattr(rx, "RayActorError", None), getattr(rx, "ActorUnavailableError", None),
                             getattr(rx, "ActorDiedError", None)) if isinstance(t, type))



class Router:
    def __init__(self, spec: Spec, *replicas: Any) -> None:
        self.spec = spec
        self.replicas = list(replicas)
        self.n = len(self.replicas)
        self.ring = Ring(self.n)
        self.inflight = [0] * self.n
        self.down: set[int] = set()
        self.index: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(self.n)]
        self.turn = itertools.count()          # ties between least loaded replicas
        self.rotation = itertools.count()      # routing="round_robin"
        self.failures = _failure_types()
        self.routing_info: dict[str, Any] | None = None
        self.template: Any = None
        self.prober: asyncio.Task[None] | None = None
        self.routed = 0
        self.routing_s = 0.0           # time spent choosing replicas (the router's own cost)
        self.affinity_hits = 0         # requests sent where a cached prefix was likely

    # -- choosing -------------------------------------------------------------------------------
    def live(self) -> set[int]:
        up = set(range(self.n)) - self.down
        return up or set(range(self.n))       # all marked down: try them anyway

    def least_loaded(self, live: set[int]) -> int:
        low = min(self.inflight[i] for i in live)
        tied = sorted(i for i in live if self.inflight[i] == low)
        return tied[next(self.turn) % len(tied)]

    async def load_routing_info(self) -> None:
        """The tokenizer, chat template and page size, from a replica, once."""
        if self.routing_info is None:
            info = await self.replicas[0].routing_info.remote()
            if self.routing_info is None:
                source, specials = info["template"]
                if source:
                    from ..server.chat import ChatTemplate
                    self.template = ChatTemplate(source, specials)
                self.routing_info = info

    def prompt_keys(self, body: Any, chat: bool) -> list[bytes]:
        """The chained page keys of the prompt's full pages (the first prompt of a batch), as the
        prefix cache keys them; [] when the prompt cannot be read (the replica will say why). A
        chat is rendered as the server renders it (protocol.chat_template_inputs: its tools, the
        history's tool turns, tool_choice's instructions) and encoded as it encodes it
        (chat.encode_chat: special-token text in content escaped, unless the replicas allow it),
        so the key is the replica's own: chats that differ only in tools key different pages."""
        if not isinstance(body, dict) or self.routing_info is None:
            return []
        info = self.routing_info
        tok, ps = info["tokenizer"], info["page_size"]
        try:
            if chat:
                from ..server.chat import encode_chat
                from ..server.protocol import chat_template_inputs
                from ..tools import FORMATS, GENERIC
                if self.template is None or not isinstance(body.get("messages"), list):
                    return []
                fmt = FORMATS.get(info.get("tool_format", ""), GENERIC)
                _, messages, extra = chat_template_inputs(body, body["messages"], fmt)
                ids = encode_chat(tok, self.template, messages, bool(info.get("allow_special_tokens_in_content")),
                                  extra)
            else:
                prompt = body.get("prompt")
                if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                    prompt = prompt[0]
                if isinstance(prompt, str):
                    ids = list(tok.encode(prompt))
                elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                    ids = prompt
                else:
                    return []
        except Exception:
            return []
        salt = body.get("cache_salt")
        ns = namespace(self.spec.served_model_name, salt if isinstance(salt, str) else None)
        keys: list[bytes] = []
        for i in range((len(ids) - 1) // ps):
            keys.append(page_key(keys[-1] if keys else b"", ids[i * ps:(i + 1) * ps], ns))
        return keys

    def by_prefix(self, keys: list[bytes], live: set[int]) -> int:
        if self.spec.routing == "round_robin":
            return sorted(live)[next(self.rotation) % len(live)]
        least = self.least_loaded(live)
        if not keys:
            pick = least
        else:
            depth = {}
            for i in live:
                d = 0
                for k in keys:
                    if k not in self.index[i]:
                        break
                    d += 1
                depth[i] = d
            best = max(live, key=lambda i: (depth[i], -self.inflight[i]))
            ok = depth[best] > 0 and self.inflight[best] < self.inflight[least] + self.spec.prefix_load_cap
            pick = best if ok else least
            self.affinity_hits += ok
        remembered = self.index[pick]
        for k in keys:
            remembered[k] = None
            remembered.move_to_end(k)
        while len(remembered) > INDEX_KEYS:
            remembered.popitem(last=False)
        return pick

    def owner(self, path: str, headers: dict[str, str]) -> int | None:
        """The replica a request must go to: the one it pins, the one holding the id in its path,
        its Idempotency-Key's owner; None when the router may choose. LookupError: a pin to no
        replica."""
        pinned = headers.get(REPLICA_HEADER)
        if pinned is not None:
            m = re.fullmatch(r"replica-(\d+)", pinned.strip())
            if m is None or int(m.group(1)) >= self.n:
                raise LookupError(f"{REPLICA_HEADER}: no replica {pinned!r} (replica-0 .. replica-{self.n - 1})")
            return int(m.group(1))
        m = re.match(r"^/v1/(?:requests|responses)/([^/]+)", path)
        if m is not None:
            tag = ID_TAG.match(m.group(1))
            if tag is not None and int(tag.group(1)) < self.n:
                return int(tag.group(1))
            return self.ring.owner("id:" + m.group(1), self.live())
        key = headers.get("idempotency-key")
        if key is not None:
            return self.ring.owner("key:" + key, self.live())
        return None

    async def choose(self, method: str, path: str, headers: dict[str, str], body: bytes) -> int:
        i = self.owner(path, headers)
        if i is not None:
            return i
        if method == "POST" and path in PROMPTED:
            prefix = self.spec.routing == "prefix"
            keys = await self.body_keys(body, path.endswith("chat/completions")) if prefix else []
            return self.by_prefix(keys, self.live())
        return self.least_loaded(self.live())

    async def body_keys(self, body: bytes, chat: bool) -> list[bytes]:
        """prompt_keys of a body, computed off the event loop (a long prompt's tokenizing and
        hashing must not hold up the router's other requests); none for a body over the
        replicas' max_body_bytes (read_body refused it already) or one that is not JSON."""
        if self.routing_info is None or len(body) > self.max_body_bytes:
            return []

        def keys() -> list[bytes]:
            try:
                parsed = json.loads(body)
            except ValueError:
                return []
            return self.prompt_keys(parsed, chat)
        return await asyncio.to_thread(keys)

    # -- failures -----------------------------------------------------------------------------
    def mark_down(self, i: int, why: BaseException) -> None:
        if i not in self.down:
            log.warning("replica-%d failed (%s: %s); routing around it until it answers", i, type(why).__name__, why)
        self.down.add(i)
        self.index[i].clear()             # its replacement starts with an empty cache
        if self.prober is None or self.prober.done():
            self.prober = asyncio.ensure_future(self._probe())

    async def _probe(self) -> None:
        while self.down:
            await asyncio.sleep(PROBE_S)
            for i in sorted(self.down):
                try:
                    await asyncio.wait_for(self.replicas[i].ping.remote(), 5.0)
                except Exception:
                    continue
                log.warning("replica-%d answers again", i)
                self.down.discard(i)

    # -- HTTP -----------------------------------------------------------------------------------
    def view(self) -> dict[str, Any]:
        """GET /v1/replicas: requests in flight per replica, those marked down, the routing cost."""
        return {"replicas": [{"name": f"replica-{i}", "in_flight": self.inflight[i], "down": i in self.down}
                             for i in range(self.n)],
                "routed": self.routed, "routing_s": self.routing_s, "affinity_hits": self.affinity_hits,
                "routing": self.spec.routing}

    @property
    def max_body_bytes(self) -> int:
        return int(self.spec.server.get("max_body_bytes", 1 << 20))

    async def read_body(self, request: Any) -> bytes:
        """The body, up to the replicas' max_body_bytes (past it: 413, as a replica answers,
        without reading or holding the rest)."""
        from ..server.errors import ApiError
        most = self.max_body_bytes
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > most:
            raise ApiError(413, f"request body over {most} bytes")
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > most:
                raise ApiError(413, f"request body over {most} bytes")
        return bytes(data)

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        from ..server.errors import ApiError
        method, path = request.method, request.url.path
        if path == "/v1/replicas" and method == "GET":          # the router's own view
            return JSONResponse(self.view())
        headers = {k.lower(): v for k, v in request.headers.items()}
        try:
            body = await self.read_body(request)
            if self.routing_info is None and self.spec.routing == "prefix":
                await self.load_routing_info()
            t0 = time.perf_counter()          # the router's own cost: choosing (a prompt's keys included)
            try:
                i = await self.choose(method, path, headers, body)
            except LookupError as e:
                raise ApiError(400, str(e), param="X-Pagedecode-Replica", code="invalid_value") from None
        except ApiError as e:
            return JSONResponse(e.body(), e.status, headers=e.headers)
        self.routing_s += time.perf_counter() - t0
        self.routed += 1
        return await self.forward(i, request.scope, method, path, body)

    async def forward(self, i: int, scope: dict[str, Any], method: str, path: str, body: bytes) -> Any:
        """Hand the request to replica i and relay its answer as it comes (its in-flight count
        held until the answer ends, however it ends)."""
        from starlette.responses import StreamingResponse
        name = f"replica-{i}"
        raw = [(k, v) for k, v in scope.get("headers", []) if k.lower() != REPLICA_HEADER.encode()]
        self.inflight[i] += 1
        done = False

        def finish() -> None:
            nonlocal done
            if not done:
                done = True
                self.inflight[i] -= 1
        try:
            gen = self.replicas[i].options(stream=True).handle.remote(
                method, path, scope.get("query_string", b""), raw, body, scope.get("client"), scope.get("server"))
            stream = gen.__aiter__()
            _, status, reply_headers = await stream.__anext__()
        except BaseException as e:
            finish()
            if isinstance(e, asyncio.CancelledError):
                raise
            if isinstance(e, self.failures):
                self.mark_down(i, e)
            return failed_before_answering(name, e)
        out, media = relayed_headers(reply_headers, name)
        sse = media is not None and media.startswith("text/event-stream")

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for _, chunk in stream:
                    yield chunk
            except (asyncio.CancelledError, GeneratorExit):
                gen.cancel()              # the client went away: so does the replica's request
                raise
            except BaseException as e:
                if isinstance(e, self.failures):
                    self.mark_down(i, e)
                if not sse:
                    raise
                yield failed_during_stream(name, e)     # never a silent cut: an error chunk, then [DONE]
            finally:
                finish()
        return StreamingResponse(relay(), status_code=status, headers=out, media_type=media)


def relayed_headers(reply_headers: list[tuple[bytes, bytes]], name: str) -> tuple[dict[str, str], str | None]:
    """The replica's response headers as the router answers them, and its media type. Serve's
    proxy always adds its own X-Request-Id: pagedecode's comes as X-Pagedecode-Request-Id."""
    out = {k.decode("latin-1"): v.decode("latin-1") for k, v in reply_headers   # the replica's id once, below
           if k.lower() not in (b"content-length", b"content-type", b"x-request-id", b"x-pagedecode-request-id")}
    rid = next((v.decode("latin-1") for k, v in reply_headers if k.lower() == b"x-request-id"), None)
    if rid is not None:
        out["X-Pagedecode-Request-Id"] = rid
    out["X-Pagedecode-Replica"] = name
    media = next((v.decode("latin-1") for k, v in reply_headers if k.lower() == b"content-type"), None)
    return out, media


def failed_before_answering(name: str, e: BaseException) -> Any:
    from starlette.responses import JSONResponse
    return JSONResponse({"error": {"message": f"{name} failed before answering: {type(e).__name__}; "
                                              "retry (the same Idempotency-Key runs anew)",
                                   "type": "server_error", "param": None, "code": "replica_failed"}},
                        503, headers={"Retry-After": "1", "X-Pagedecode-Replica": name})


def failed_during_stream(name: str, e: BaseException) -> bytes:
    err = {"error": {"message": f"{name} failed during this stream ({type(e).__name__}); retry with the same "
                                "Idempotency-Key to run it anew",
                     "type": "server_error", "param": None, "code": "replica_failed"}}
    return f"data: {json.dumps(err)}\n\n".encode() + b"data: [DONE]\n\n"
