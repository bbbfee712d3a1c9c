"""The `pagedecode serve` command: load a model, start uvicorn, drain gracefully on SIGINT/SIGTERM."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import socket
import sys
from dataclasses import MISSING, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from ..runtime.config import EngineConfig
from ..runtime.heap import thaw_heap

if TYPE_CHECKING:           # starlette and the server load only when serving
    from starlette.applications import Starlette

    from ..runtime.async_engine import AsyncEngine
    from .state import ServerState
    from .transport import ConnectionLimits

log = logging.getLogger("pagedecode.server")
ENGINE_FLAGS = [f for f in fields(EngineConfig) if f.name not in ("model_name", "speculative")]
FLUSH_S = 5.0     # after the drain: for cancels to take effect and clients to get their endings


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default shown once: appended, unless the help already says it or there is
    nothing to say (None, whose meaning the help gives, and an off flag)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "(default" in text or action.default is None or (action.nargs == 0 and action.default is False):
            return text
        return super()._get_help_string(action)


def positive(text: str) -> int:
    """argparse's type for a count: an integer >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """What to load and where: --model, --quantization, --tokenizer, --device, --dtype,
    --tensor-parallel-size (generate, demo and serve)."""
    p.add_argument("--model", default=None,
                   help="Hugging Face model directory or GGUF file (default: the built-in tiny Llama)")
    p.add_argument("--quantization", default=None, choices=["q8_0", "q4_0"],
                   help="keep the layer weights quantized in memory (a GGUF's own Q8_0 / Q4_0 stay so anyway)")
    p.add_argument("--tokenizer", default=None, help="a folder holding tokenizer.json, instead of the model's own")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="the weights' dtype, and the KV cache's unless --kv-cache-dtype says otherwise "
                        "(default: float32 on CPU, the checkpoint's on CUDA)")
    p.add_argument("--tensor-parallel-size", type=positive, default=1,
                   help="ranks the model is sharded over (processes started by the engine)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (loopback unless told otherwise)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (0: any free port)")
    p.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY'; repeat it for more tenants (each key one tenant, "
                        "who sees only its own requests)")
    p.add_argument("--api-keys-file", default=None,
                   help="a file of API keys, one a line (blank lines and lines starting with # skipped)")
    p.add_argument("--metrics-public", action="store_true", help="serve /metrics without a key when keys are set")
    p.add_argument("--allowed-host", action="append", default=None,
                   help="a Host name the server answers to besides its address and localhost ('*': any); "
                        "repeatable")
    p.add_argument("--allow-special-tokens-in-content", action="store_true",
                   help="chat content's special-token strings ('</s>') become the real tokens (unsafe)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the folder name, or the GGUF file's without .gguf)")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file (default: the model's)")
    p.add_argument("--max-queued-requests", type=int, default=256, help="waiting requests before 429")
    p.add_argument("--max-prompts-per-request", type=int, default=64,
                   help="prompts one completions request may batch (400 beyond); its choices, prompts x n, are at "
                        "most this or 16, whichever is more")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (413 beyond)")
    p.add_argument("--max-request-seconds", type=float, default=None, help="cap on timeout and first_token_timeout")
    p.add_argument("--max-tokens-cap", type=int, default=4096, help="largest max_tokens a request may ask")
    p.add_argument("--max-connections", type=int, default=None,
                   help="open connections at once; at the cap a new one closes the longest-idle one, or gets 503 "
                        "when every connection has a request running (default: 2048, less to fit the open-file limit)")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds from connecting (or a kept-alive connection's next byte) to complete request headers")
    p.add_argument("--body-timeout", type=float, default=20.0,
                   help="seconds from the request headers to the body's last byte (408 and closed beyond)")
    p.add_argument("--keep-alive-timeout", type=float, default=5.0,
                   help="seconds an idle connection is kept open between requests")
    p.add_argument("--grace-seconds", type=float, default=10.0, help="on shutdown, how long live requests may finish")
    p.add_argument("--log-text", action="store_true", help="include output text in the per-request log line")
    p.add_argument("--resume-grace", type=float, default=0.0,
                   help="seconds a disconnected stream waits for a client to resume it before it is cancelled")
    p.add_argument("--on-disconnect", default="cancel", choices=["cancel", "continue"],
                   help="what a client going away does to its request (a request's on_disconnect field overrides)")
    p.add_argument("--idempotency-ttl", type=float, default=600.0, help="seconds an Idempotency-Key is kept")
    p.add_argument("--idempotency-max-keys", type=int, default=10_000, help="most Idempotency-Keys kept")
    p.add_argument("--metrics-compat", default=None, choices=["vllm"],
                   help="also export the gauges an inference gateway reads under vLLM's names "
                        "(vllm:num_requests_waiting, ...), so llm-d / KServe can route to this server")
    p.add_argument("--kv-events", default=None, metavar="ENDPOINT",
                   help="publish the prefix cache's changes in vLLM's KV-event format on this ZeroMQ endpoint "
                        "(tcp://*:5557 binds, tcp://host:port connects; pagedecode[ray])")
    p.add_argument("--kv-events-replay", default=None, metavar="ENDPOINT",
                   help="the KV events' replay socket (default: the publisher's port + 1 when it binds a port)")
    p.add_argument("--kv-events-topic", default="", help="the ZeroMQ topic of the KV events")
    p.add_argument("--ray", action="store_true",
                   help="serve replicas on Ray Serve (pagedecode[ray]): a local Ray cluster, or --ray-address's")
    p.add_argument("--replicas", type=int, default=2, help="with --ray: engine replicas, each one engine")
    p.add_argument("--ray-address", default=None, help="with --ray: join this Ray cluster instead of starting one")
    for f in ENGINE_FLAGS:
        flag = "--" + f.name.replace("_", "-")
        # a field whose default comes from the environment (default_factory) is read now
        default = f.default_factory() if f.default is MISSING and f.default_factory is not MISSING else f.default
        kind: Any = type(default) if default is not None else None
        extra: dict[str, Any] = {}
        if isinstance(default, bool):
            kind, extra = _bool, {"nargs": "?", "const": True}     # `--deterministic` alone means true
        if f.name in ("max_cache_tokens", "memory_budget_bytes", "max_context", "seed", "max_finished_bytes"):
            kind = int
        p.add_argument(flag, type=kind, default=default, dest="engine_" + f.name, metavar=f.name.upper(),
                       help=f"EngineConfig.{f.name}", **extra)
    add_speculative_arguments(p)


def add_speculative_arguments(p: argparse.ArgumentParser) -> None:
    """--speculative-method, --num-speculative-tokens, --draft-model (generate, demo and serve)."""
    p.add_argument("--speculative-method", default=None, choices=["ngram", "draft"],
                   help="speculative decoding: ngram (prompt lookup in each request's own tokens) or "
                        "draft (a smaller model, --draft-model); off by default")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="draft tokens proposed per step")
    p.add_argument("--draft-model", default=None, help="the draft model's directory (--speculative-method draft)")


def speculative_config(args: argparse.Namespace) -> Any:
    """The SpeculativeConfig the flags ask for, or None; bad values raise ValueError."""
    from ..runtime.config import SpeculativeConfig
    if args.speculative_method is None:
        if args.draft_model is not None:
            raise ValueError("--draft-model needs --speculative-method draft")
        return None
    return SpeculativeConfig(method=args.speculative_method, num_tokens=args.num_speculative_tokens,
                             draft_model=args.draft_model)


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def main(argv: list[str] | None = None, parsed: argparse.Namespace | None = None) -> int:
    import pagedecode as pd

    from ..model.default_model import default_model_path
    from .transport import ConnectionLimits, default_max_connections
    if parsed is None:
        ap = argparse.ArgumentParser(prog="pagedecode serve", formatter_class=HelpFormatter)
        add_arguments(ap)
        parsed = ap.parse_args(argv)
    args = parsed
    try:
        limits = ConnectionLimits(max_connections=args.max_connections or default_max_connections(),
                                  header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                                  keep_alive_timeout_s=args.keep_alive_timeout)
        keys = api_keys(args)          # a bad key file fails before the model loads
        speculative = speculative_config(args)
    except ValueError as e:
        print(f"pagedecode serve: {e}", file=sys.stderr)
        return 2
    if args.ray:
        print("pagedecode serve: --ray is run by `pagedecode serve` (pagedecode.cli)", file=sys.stderr)
        return 2
    options = {f.name: getattr(args, "engine_" + f.name) for f in ENGINE_FLAGS}
    try:
        EngineConfig(**options)                          # a bad engine option: one line, before loading
    except ValueError as e:
        print(f"pagedecode serve: {e}", file=sys.stderr)
        return 2
    try:
        sock = listen_socket(args.host, args.port)      # before loading: a taken port is one line, at once
    except OSError as e:
        print(f"pagedecode serve: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    model_dir = Path(args.model) if args.model else default_model_path()
    options["speculative"] = speculative
    name = args.served_model_name or (model_dir.stem if model_dir.is_file() else model_dir.name)
    try:
        engine = pd.Engine.from_pretrained(model_dir, device=args.device, dtype=args.dtype, model_name=name,
                                           tensor_parallel_size=args.tensor_parallel_size,
                                           quantization=args.quantization, tokenizer=args.tokenizer, **options)
    except ValueError as e:                              # options that do not fit this model (kv_cache_dtype)
        sock.close()
        print(f"pagedecode serve: {e}", file=sys.stderr)
        return 2
    publisher = None
    try:
        if args.kv_events is not None:
            from ..kv_events import KVEventPublisher, default_replay
            try:
                publisher = KVEventPublisher(args.kv_events, args.kv_events_replay or default_replay(args.kv_events),
                                             block_size=engine.config.page_size, topic=args.kv_events_topic,
                                             medium="GPU" if engine.device.type == "cuda" else "CPU").attach(engine)
            except ValueError as e:
                print(f"pagedecode serve: --kv-events: {e}", file=sys.stderr)
                return 2
        ae = pd.AsyncEngine(engine)
        app = server_app(args, ae, model_dir, keys)
        pd.freeze_heap()          # torch's heap out of every full GC pass (runtime/heap.py)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        capacity = engine.snapshot().pages_total * engine.config.page_size
        log.info("%s: %s weights (%.1f MB), KV cache of %d tokens in %s (%.1f MB)", name,
                 str(engine.model.dtype).removeprefix("torch."), engine.weight_bytes / 1e6, capacity,
                 str(engine.kv_cache_dtype).removeprefix("torch."), capacity * engine.bytes_per_token_total / 1e6)
        if publisher is not None:
            log.info("KV events on %s (replay: %s)", publisher.address, publisher.replay_address)
        run_uvicorn(args, app, ae, sock, limits)
    finally:
        engine.close()            # tensor-parallel workers stop here, told to, not at interpreter exit
        if publisher is not None:
            publisher.close()
        thaw_heap()
    return 0


def server_options(args: argparse.Namespace, keys: tuple[str, ...]) -> dict[str, Any]:
    """build_app's options (ServerOptions fields) from the command line."""
    from .protocol import Limits
    return dict(api_keys=keys, metrics_public=args.metrics_public, allowed_hosts=allowed_hosts(args),
                allow_special_tokens_in_content=args.allow_special_tokens_in_content,
                limits=Limits(max_tokens=args.max_tokens_cap, max_request_seconds=args.max_request_seconds),
                max_queued_requests=args.max_queued_requests, max_body_bytes=args.max_body_bytes,
                max_prompts_per_request=args.max_prompts_per_request, log_text=args.log_text,
                resume_grace_s=args.resume_grace, on_disconnect=args.on_disconnect,
                idempotency_ttl_s=args.idempotency_ttl, idempotency_max_keys=args.idempotency_max_keys,
                metrics_compat=args.metrics_compat)


def server_app(args: argparse.Namespace, ae: AsyncEngine, model_dir: Path, keys: tuple[str, ...]) -> Starlette:
    """The app over `ae` as the command line configures it (its lifespan starts and drains `ae`)."""
    from .app import build_app
    from .chat import ChatTemplate, load_template
    source, specials = load_template(model_dir, args.chat_template)
    template = ChatTemplate(source, specials) if source else None
    app = build_app(ae, model_name=ae.engine.model_name, chat_template=template, **server_options(args, keys),
                    generation_defaults=generation_defaults(model_dir))
    app.router.lifespan_context = lifespan(ae, app, args.grace_seconds)
    return app


def run_uvicorn(args: argparse.Namespace, app: Starlette, ae: AsyncEngine, sock: socket.socket,
                limits: ConnectionLimits) -> None:
    """Serve on `sock` until a signal's drain has ended (transport.py: DrainingServer)."""
    import uvicorn

    from .state import ServerState
    from .transport import BACKLOG, DrainingServer, GuardedH11Protocol
    config = uvicorn.Config(app, host=args.host, port=sock.getsockname()[1], log_level="info",
                            http=GuardedH11Protocol.configured(limits), ws="none",
                            timeout_keep_alive=limits.keep_alive_timeout_s,  # type: ignore[arg-type]
                            timeout_graceful_shutdown=int(FLUSH_S), backlog=BACKLOG)
    state = app.state.pagedecode
    assert isinstance(state, ServerState)

    def stop_admitting() -> None:
        state.draining = True
    DrainingServer(config, lambda hurry: drain(ae, state, args.grace_seconds, hurry),
                   stop_admitting).run(sockets=[sock])


def listen_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything slow starts (OSError when the port is taken)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """The tenants' keys: every --api-key, then --api-keys-file's lines."""
    keys = list(args.api_key or [])
    if args.api_keys_file is not None:
        try:
            lines = Path(args.api_keys_file).read_text().splitlines()
        except OSError as e:
            raise ValueError(f"--api-keys-file: {e}") from None
        listed = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
        if not listed:                 # an empty file must not leave the server open
            raise ValueError(f"--api-keys-file {args.api_keys_file} holds no key")
        keys += listed
    if any(not k or k != k.strip() for k in keys):
        raise ValueError("an API key is empty or has surrounding whitespace")
    return tuple(keys)


def allowed_hosts(args: argparse.Namespace) -> tuple[str, ...]:
    """--allowed-host values and --host (a wildcard address such as 0.0.0.0 names no one: a
    connection's own address is accepted anyway, guard.py)."""
    import ipaddress
    try:
        wildcard = ipaddress.ip_address(args.host).is_unspecified
    except ValueError:
        wildcard = False
    return tuple(args.allowed_host or []) + (() if wildcard else (args.host,))


def lifespan(ae: AsyncEngine, app: Starlette, grace_s: float
             ) -> Callable[[Any], contextlib.AbstractAsyncContextManager[None]]:
    @contextlib.asynccontextmanager
    async def run(_: Any) -> AsyncIterator[None]:
        warming = ae.engine.warm_grammar()      # the first constrained request then stalls nobody
        if warming is not None:
            try:
                await asyncio.wrap_future(warming)
            except Exception:       # a broken xgrammar fails constrained requests, not the server
                logging.getLogger("pagedecode.server").exception("structured output is unavailable")
        ae.start()
        try:
            yield
        finally:
            await drain(ae, app.state.pagedecode, grace_s)
            await ae.shutdown()
    return run


async def drain(ae: AsyncEngine, state: ServerState, grace_s: float, hurry: Callable[[], bool] = lambda: False) -> None:
    """Stop admitting (/health and new requests answer 503); let live requests finish for up to
    grace_s (or until hurry() says stop waiting); then cancel the rest, each ending once, and wait
    until every one has ended, so its client gets its final chunk and [DONE] (or its result)."""
    state.draining = True
    engine = ae.engine
    if not ae.running or not engine.has_unfinished():
        return
    log.info("drain: admitting nothing more; live requests have %.1f s to finish", grace_s)
    loop = asyncio.get_running_loop()
    end = loop.time() + grace_s
    while engine.has_unfinished() and loop.time() < end and not hurry():
        await asyncio.sleep(0.05)
    cancelled = engine.cancel_all()
    if cancelled:
        log.info("drain: grace over, %d live requests cancelled", cancelled)
    end = loop.time() + FLUSH_S
    while engine.has_unfinished() and loop.time() < end:     # the step loop applies the cancels
        await asyncio.sleep(0.02)


def generation_defaults(model_dir: Path) -> dict[str, Any]:
    """Sampling defaults from generation_config.json (temperature, top_p, top_k, ...)."""
    f = model_dir / "generation_config.json"
    if not f.is_file():
        return {}
    cfg = json.loads(f.read_text())
    out = {k: cfg[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty") if k in cfg}
    if cfg.get("do_sample") is False:
        out["temperature"] = 0.0       # the checkpoint asks for greedy decoding
    return out
