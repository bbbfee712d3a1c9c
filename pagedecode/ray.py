"""Replicas on Ray Serve (pagedecode[ray]): `build_app(model, num_replicas=2, ...)`, and
`pagedecode serve --ray --replicas N [--ray-address ADDR]`.

    client --HTTP--> Serve proxy --> router (one deployment, the ingress)
                                        |  handle calls, streamed
                                        v
                      replica-0, replica-1, ...  (one deployment each, one engine each)

Each replica runs the server's own ASGI app (server/app.py build_app) over its engine: the
router hands it the request's method, path, headers and body, and relays what the app sends
(status, headers, body chunks) back as it comes. Behaviour is the server's, one code path; the
router only chooses the replica and names it in the `X-Pagedecode-Replica` response header.

Routing keeps the request contract across replicas:
- a request with an `Idempotency-Key` goes to the key's owner on a consistent-hash ring (64
  points per replica), so a retry attaches to its first generation;
- a request id names its replica (each replica's ids start `req-rN-`, EngineConfig's
  request_id_prefix), so `/v1/requests/{id}/events` and `/trace` reach the replica holding it;
- other completions prefer the replica whose prefix cache likely holds the prompt's start:
  the router keys the prompt's full pages with the prefix cache's own chained page hash
  (runtime/prefix_cache.py page_key, the model name and cache_salt as namespace), remembers
  which keys it sent where, and picks the replica matching the longest chain, unless that one
  has `prefix_load_cap` more requests in flight than the least loaded (then the least loaded);
  routing="round_robin" turns this off (the benchmark's baseline);
- `X-Pagedecode-Replica: replica-N` on a request pins it (a replica's own /metrics, say).

Ray Serve's proxy always answers with its own `X-Request-Id`; the replica's (the pagedecode
request id, also each body's `id`) comes as `X-Pagedecode-Request-Id`. `GET /v1/replicas` is the
router's view: requests in flight per replica, replicas marked down, its routing time.

A replica that dies: its streams end with an error chunk (code replica_failed) and `data:
[DONE]`, a request it had not yet answered gets 503 replica_failed; the router routes around it
(a retry with the same key runs anew on the next live replica on the ring) and probes it until
Ray Serve has started its replacement. Ray Serve's own request router API picks among the
replicas of one deployment from the pickled request; the router deployment here reads headers
and body itself and keeps each replica addressable by name, so it is used instead.
"""
from __future__ import annotations

import asyncio
import bisect
import hashlib
import itertools
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, AsyncIterator, MutableMapping

from .runtime.config import EngineConfig
from .runtime.prefix_cache import namespace, page_key

log = logging.getLogger("pagedecode.ray")

REPLICA_HEADER = "x-pagedecode-replica"
RING_POINTS = 64                 # virtual nodes per replica on the hash ring
INDEX_KEYS = 200_000             # page keys the router remembers per replica (LRU)
PROBE_S = 0.5                    # how often a replica marked down is probed
ID_TAG = re.compile(r"^(?:req|resp)-r(\d+)-")
LOAD_OPTIONS = ("device", "dtype", "tensor_parallel_size", "quantization", "tokenizer")
ENGINE_OPTIONS = tuple(f.name for f in fields(EngineConfig) if f.name not in ("model_name", "request_id_prefix"))
ROUTINGS = ("prefix", "round_robin")


def _server_option_names() -> tuple[str, ...]:
    from .server.state import ServerOptions
    return tuple(f.name for f in fields(ServerOptions) if f.name != "model_name")


@dataclass
class Spec:
    """What every replica builds and the router routes by (pickled to each)."""
    model: str
    served_model_name: str
    load: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    server: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None
    num_replicas: int = 2
    routing: str = "prefix"
    prefix_load_cap: int = 8
    torch_threads: int | None = None
    grace_s: float = 5.0
    kv_events: str | None = None
    kv_events_replay: str | None = None
    kv_events_topic: str = ""


def build_app(model: str | os.PathLike[str] | None = None, num_replicas: int = 2, **options: Any) -> Any:
    """A Ray Serve application: `num_replicas` replicas each holding one engine of `model` (a
    Hugging Face directory or GGUF file; None: the built-in tiny Llama), behind a router that
    serves pagedecode's OpenAI routes (run it with `ray.serve.run(app)`).

    options: EngineConfig fields (page_size, max_batch_size, ...), the loader's (device, dtype,
    tensor_parallel_size, quantization, tokenizer), build_app's server options (api_keys,
    limits, metrics_compat, ...), served_model_name, chat_template (a file), and for Ray:
    ray_actor_options (each replica's CPUs / GPUs; default 1 CPU), router_actor_options
    (default 0 CPUs), routing ("prefix" or "round_robin"), prefix_load_cap, torch_threads (per
    replica; default: the replica's CPUs), grace_s (a replica's drain on shutdown),
    health_check_period_s, kv_events / kv_events_replay / kv_events_topic (each replica publishes
    its prefix cache's KV events as data_parallel_rank N, vLLM's way for data-parallel engines: a
    connected endpoint is shared, a bound one and the replay endpoint are offset by N)."""
    from ray import serve

    from .model.default_model import default_model_path
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be an integer >= 1, got {num_replicas!r}")
    path = Path(model) if model is not None else default_model_path()     # made here once, not per replica
    if not path.exists():
        raise ValueError(f"model {str(path)!r} does not exist")
    opts = dict(options)
    replica_opts = dict(opts.pop("ray_actor_options", None) or {"num_cpus": 1})
    router_opts = dict(opts.pop("router_actor_options", None) or {"num_cpus": 0})
    health_s = float(opts.pop("health_check_period_s", 2.0))
    spec = Spec(model=str(path.resolve()), num_replicas=num_replicas,
                served_model_name=opts.pop("served_model_name", None) or (path.stem if path.is_file() else path.name),
                chat_template=opts.pop("chat_template", None), routing=opts.pop("routing", "prefix"),
                prefix_load_cap=int(opts.pop("prefix_load_cap", 8)), torch_threads=opts.pop("torch_threads", None),
                grace_s=float(opts.pop("grace_s", 5.0)), kv_events=opts.pop("kv_events", None),
                kv_events_replay=opts.pop("kv_events_replay", None), kv_events_topic=opts.pop("kv_events_topic", ""))
    if spec.routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {spec.routing!r}")
    server_names = _server_option_names()
    for k in list(opts):
        if k in LOAD_OPTIONS:
            spec.load[k] = opts.pop(k)
        elif k in ENGINE_OPTIONS:
            spec.engine[k] = opts.pop(k)
        elif k in server_names:
            spec.server[k] = opts.pop(k)
    if opts:
        raise TypeError(f"build_app() got unknown options: {', '.join(sorted(opts))}")
    EngineConfig(**spec.engine)       # a bad engine option fails here, not in every replica
    if spec.torch_threads is None:
        spec.torch_threads = max(1, int(replica_opts.get("num_cpus") or 1))
    replicas = [serve.deployment(name=f"replica-{i}", num_replicas=1, ray_actor_options=replica_opts,
                                 max_ongoing_requests=4096, health_check_period_s=health_s,
                                 health_check_timeout_s=max(10.0, 5 * health_s),
                                 graceful_shutdown_timeout_s=spec.grace_s + 5)(EngineReplica).bind(i, spec)
                for i in range(num_replicas)]
    return serve.deployment(name="router", num_replicas=1, ray_actor_options=router_opts,
                            max_ongoing_requests=100_000)(Router).bind(spec, *replicas)


# -- a replica: one engine, the server's ASGI app ---------------------------------------------
class EngineReplica:
    def __init__(self, index: int, spec: Spec) -> None:
        import torch

        import pagedecode as pd

        from .server.app import build_app as build_asgi
        from .server.chat import ChatTemplate, load_template
        from .server.serve import generation_defaults
        if spec.torch_threads:
            torch.set_num_threads(spec.torch_threads)
        self.index, self.name = index, f"replica-{index}"
        self.spec = spec
        engine = pd.Engine.from_pretrained(spec.model, model_name=spec.served_model_name,
                                           request_id_prefix=f"req-r{index}-", **spec.load, **spec.engine)
        source, specials = load_template(spec.model, spec.chat_template)
        self.template = (source, specials)
        self.ae = pd.AsyncEngine(engine)
        self.app = build_asgi(self.ae, model_name=spec.served_model_name,
                              chat_template=ChatTemplate(source, specials) if source else None,
                              generation_defaults=generation_defaults(Path(spec.model)), **spec.server)
        self.state = self.app.state.pagedecode
        self._started: asyncio.Future[None] | None = None
        self.publisher = None
        if spec.kv_events is not None:
            from .kv_events import KVEventPublisher, binds, default_replay, offset_port
            replay = spec.kv_events_replay or default_replay(spec.kv_events)
            self.publisher = KVEventPublisher(
                offset_port(spec.kv_events, index) if binds(spec.kv_events) else spec.kv_events,
                offset_port(replay, index) if replay is not None else None, block_size=engine.config.page_size,
                topic=spec.kv_events_topic, data_parallel_rank=index,
                medium="GPU" if engine.device.type == "cuda" else "CPU").attach(engine)

    async def _start(self) -> None:
        if self._started is None:
            self._started = asyncio.get_running_loop().create_future()
            warming = self.ae.engine.warm_grammar()
            if warming is not None:
                try:
                    await asyncio.wrap_future(warming)
                except Exception:
                    log.exception("structured output is unavailable")
            self.ae.start()
            self._started.set_result(None)
        await self._started

    async def handle(self, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]], body: bytes,
                     client: tuple[str, int] | None, server: tuple[str, int] | None) -> AsyncIterator[Any]:
        """Run one HTTP request through the app: yields ("start", status, headers), then
        ("body", bytes) chunks. Cancelled (the client went away): the app sees a disconnect."""
        await self._start()
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
                 "query_string": query, "headers": headers, "client": client, "server": server,
                 "state": {}}
        sent: asyncio.Queue[MutableMapping[str, Any] | None] = asyncio.Queue()
        gone = asyncio.Event()
        given = False

        async def receive() -> dict[str, Any]:
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            await sent.put(message)

        task = asyncio.ensure_future(self.app(scope, receive, send))
        task.add_done_callback(lambda _: sent.put_nowait(None))
        try:
            while True:
                m = await sent.get()
                if m is None:
                    task.result()         # the app's own exception, if it raised one
                    return
                if m["type"] == "http.response.start":
                    yield ("start", m["status"], [(k, v) for k, v in m.get("headers", [])])
                elif m["type"] == "http.response.body":
                    if m.get("body"):
                        yield ("body", m["body"])
                    if not m.get("more_body", False):
                        return
        finally:
            gone.set()
            if not task.done():
                try:
                    await asyncio.wait_for(asyncio.shield(task), 5.0)
                except BaseException:
                    task.cancel()

    async def ping(self) -> dict[str, Any]:
        await self._start()
        return {"replica": self.name, "pid": os.getpid()}

    def routing_info(self) -> dict[str, Any]:
        """What the router keys prompts with: the tokenizer, the chat template, the page size."""
        return {"tokenizer": self.ae.engine.tokenizer, "template": self.template,
                "page_size": self.ae.engine.config.page_size}

    async def check_health(self) -> None:
        if self._started is not None and self._started.done() and not self.ae.running:
            raise RuntimeError(f"{self.name}: the step loop stopped")

    async def __del__(self) -> None:
        """Serve's graceful shutdown: drain, then stop the engine."""
        from .server.serve import drain
        try:
            if self._started is not None and self._started.done():
                await drain(self.ae, self.state, self.spec.grace_s)
                await self.ae.shutdown()
        finally:
            self.ae.engine.close()
            if self.publisher is not None:
                self.publisher.close()


# -- the router ------------------------------------------------------------------------------
def _failure_types() -> tuple[type[BaseException], ...]:
    from ray import exceptions as rx
    return tuple(t for t in (getattr(rx, "RayActorError", None), getattr(rx, "ActorUnavailableError", None),
                             getattr(rx, "ActorDiedError", None)) if isinstance(t, type))


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class Ring:
    """Consistent hashing: RING_POINTS points per replica; a key's owner is the first live
    replica clockwise from the key's point."""

    def __init__(self, n: int) -> None:
        self.points = sorted((_point(f"replica-{i}#{v}"), i) for i in range(n) for v in range(RING_POINTS))
        self.keys = [p for p, _ in self.points]

    def owner(self, key: str, live: set[int]) -> int | None:
        start = bisect.bisect(self.keys, _point(key))
        for k in range(len(self.points)):
            i = self.points[(start + k) % len(self.points)][1]
            if i in live:
                return i
        return None


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
                    from .server.chat import ChatTemplate
                    self.template = ChatTemplate(source, specials)
                self.routing_info = info

    def prompt_keys(self, body: Any, chat: bool) -> list[bytes]:
        """The chained page keys of the prompt's full pages (the first prompt of a batch), as the
        prefix cache keys them; [] when the prompt cannot be read (the replica will say why)."""
        if not isinstance(body, dict) or self.routing_info is None:
            return []
        info = self.routing_info
        tok, ps = info["tokenizer"], info["page_size"]
        try:
            if chat:
                if self.template is None or not isinstance(body.get("messages"), list):
                    return []
                ids = list(tok.encode(self.template.render(body["messages"]), add_special_tokens=False))
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

    def choose(self, method: str, path: str, headers: dict[str, str], body: bytes) -> int:
        live = self.live()
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
            owner = self.ring.owner("id:" + m.group(1), live)
            assert owner is not None
            return owner
        key = headers.get("idempotency-key")
        if key is not None:
            owner = self.ring.owner("key:" + key, live)
            assert owner is not None
            return owner
        if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = None
            return self.by_prefix(self.prompt_keys(parsed, path.endswith("chat/completions")), live)
        return self.least_loaded(live)

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
    async def __call__(self, request: Any) -> Any:
        from starlette.responses import JSONResponse, StreamingResponse
        body = await request.body()
        headers = {k.lower(): v for k, v in request.headers.items()}
        method, path = request.method, request.url.path
        if path == "/v1/replicas" and method == "GET":          # the router's own view
            return JSONResponse({"replicas": [{"name": f"replica-{i}", "in_flight": self.inflight[i],
                                               "down": i in self.down} for i in range(self.n)],
                                 "routed": self.routed, "routing_s": self.routing_s,
                                 "affinity_hits": self.affinity_hits, "routing": self.spec.routing})
        if self.routing_info is None and self.spec.routing == "prefix":
            await self.load_routing_info()
        t0 = time.perf_counter()          # the router's own cost: choosing, no waiting
        try:
            i = self.choose(method, path, headers, body)
        except LookupError as e:
            return JSONResponse({"error": {"message": str(e), "type": "invalid_request_error",
                                           "param": "X-Pagedecode-Replica", "code": "invalid_value"}}, 400)
        self.routing_s += time.perf_counter() - t0
        self.routed += 1
        name = f"replica-{i}"
        scope = request.scope
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
            first = await stream.__anext__()
        except BaseException as e:
            finish()
            if isinstance(e, asyncio.CancelledError):
                raise
            if isinstance(e, self.failures):
                self.mark_down(i, e)
            return JSONResponse({"error": {"message": f"{name} failed before answering: {type(e).__name__}; "
                                                      "retry (the same Idempotency-Key runs anew)",
                                           "type": "server_error", "param": None, "code": "replica_failed"}},
                                503, headers={"Retry-After": "1", "X-Pagedecode-Replica": name})
        _, status, reply_headers = first
        out = {k.decode("latin-1"): v.decode("latin-1") for k, v in reply_headers
               if k.lower() not in (b"content-length", b"content-type", b"x-request-id")}
        rid = next((v.decode("latin-1") for k, v in reply_headers if k.lower() == b"x-request-id"), None)
        if rid is not None:       # Serve's proxy always adds its own X-Request-Id: ours gets a name of its own
            out["X-Pagedecode-Request-Id"] = rid
        media = next((v.decode("latin-1") for k, v in reply_headers if k.lower() == b"content-type"), None)
        out["X-Pagedecode-Replica"] = name
        sse = media is not None and media.startswith("text/event-stream")

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for kind, chunk in stream:
                    yield chunk
            except (asyncio.CancelledError, GeneratorExit):
                gen.cancel()              # the client went away: so does the replica's request
                raise
            except BaseException as e:
                if isinstance(e, self.failures):
                    self.mark_down(i, e)
                if sse:             # never a silent cut: an error chunk, then [DONE]
                    err = {"error": {"message": f"{name} failed during this stream ({type(e).__name__}); retry "
                                                "with the same Idempotency-Key to run it anew",
                                     "type": "server_error", "param": None, "code": "replica_failed"}}
                    yield f"data: {json.dumps(err)}\n\n".encode() + b"data: [DONE]\n\n"
                else:
                    raise
            finally:
                finish()
        return StreamingResponse(relay(), status_code=status, headers=out, media_type=media)


# -- `pagedecode serve --ray` ------------------------------------------------------------------
def serve_main(args: Any) -> int:
    """Start (or join, --ray-address) a Ray cluster, run the replicas behind Serve's HTTP proxy on
    --host / --port, and shut all of it down on SIGINT / SIGTERM."""
    import ray
    from ray import serve

    from .server.serve import ENGINE_FLAGS, api_keys, server_options
    try:
        keys = api_keys(args)
    except ValueError as e:
        print(f"pagedecode serve: {e}", file=sys.stderr)
        return 2
    if args.replicas < 1:
        print("pagedecode serve: --replicas must be >= 1", file=sys.stderr)
        return 2
    options = {f.name: getattr(args, "engine_" + f.name) for f in ENGINE_FLAGS if f.name != "request_id_prefix"}
    options.update(server_options(args, keys))
    load = {"device": args.device, "dtype": args.dtype, "tensor_parallel_size": args.tensor_parallel_size,
            "quantization": args.quantization, "tokenizer": args.tokenizer}
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    ray.init(address=args.ray_address, include_dashboard=False, log_to_driver=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        app = build_app(args.model, args.replicas, served_model_name=args.served_model_name,
                        chat_template=args.chat_template, grace_s=args.grace_seconds, kv_events=args.kv_events,
                        kv_events_replay=args.kv_events_replay, kv_events_topic=args.kv_events_topic, **load, **options)
        serve.run(app, name="pagedecode", route_prefix="/", blocking=False)
        print(f"pagedecode serve: {args.replicas} replicas on Ray Serve at http://{args.host}:{args.port}", flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
