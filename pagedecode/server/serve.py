"""The `pagedecode serve` command: load a model, start uvicorn, drain gracefully on SIGINT/SIGTERM."""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterator, NoReturn

from ..runtime.footprint import describe
from .flags import HelpFormatter, add_arguments, api_keys, engine_options, server_options, speculative_config

if TYPE_CHECKING:           # starlette and the server load only when serving
    from starlette.applications import Starlette

    from ..runtime.async_engine import AsyncEngine
    from .state import ServerState
    from .transport import ConnectionLimits

log = logging.getLogger("pagedecode.server")
FLUSH_S = 5.0     # after the drain: for cancels to take effect and clients to get their endings


def main(argv: list[str] | None = None, parsed: argparse.Namespace | None = None) -> int:
    import pagedecode as pd

    from ..model.default_model import default_model_path
    from ..model.hub import resolve_model
    from .transport import ConnectionLimits, default_max_connections
    if parsed is None:
        ap = argparse.ArgumentParser(prog="pagedecode serve", formatter_class=HelpFormatter)
        add_arguments(ap)
        parsed = ap.parse_args(argv)
    args = parsed
    try:
        limits = ConnectionLimits(max_connections=args.max_connections or default_max_connections(),
                                  header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                                  keep_alive_timeout_s=args.keep_alive_timeout, min_body_rate=args.min_body_rate,
                                  max_connections_per_client=args.max_connections_per_client)
        keys = api_keys(args)          # a bad key file fails before the model loads
        speculative = speculative_config(args)
        options = engine_options(args)
    except ValueError as e:
        print(f"pagedecode serve: {e}", file=sys.stderr)
        return 2
    if args.ray:
        print("pagedecode serve: --ray is run by `pagedecode serve` (pagedecode.cli)", file=sys.stderr)
        return 2
    try:
        sock = listen_socket(args.host, args.port)      # before loading: a taken port is one line, at once
    except OSError as e:
        print(f"pagedecode serve: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    model_dir = resolve_model(args.model) if args.model else default_model_path()
    options["speculative"] = speculative
    name = args.served_model_name or (model_dir.stem if model_dir.is_file() else model_dir.name)
    try:
        with interrupt_ends_the_load():
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
        try:
            app = server_app(args, ae, model_dir, keys)
        except ValueError as e:                          # the chat template, or its limits
            print(f"pagedecode serve: {e}", file=sys.stderr)
            return 2
        engine.process.freeze_heap()   # torch's heap out of every full GC pass; thawed by engine.close()
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        log.info("%s: %s", name, describe(engine))
        if publisher is not None:
            log.info("KV events on %s (replay: %s)", publisher.address, publisher.replay_address)
        run_uvicorn(args, app, ae, sock, limits)
    finally:
        engine.close()            # tensor-parallel workers stop here, told to, not at interpreter exit; the heap thaws
        if publisher is not None:
            publisher.close()
    if engine.constraints.compiler.busy():
        exit_now(0)
    return 0


def exit_now(code: int) -> NoReturn:
    """End the process without the interpreter's exit, which joins every worker thread: the
    grammar backend's (warmed at start: its xgrammar import is ~2 s of CPU, over 10 s on a loaded
    machine; a compile can take a minute) does work nobody needs once the server has drained.
    SIGTERM during start-up waited for it (10.5 s under load). Everything else is closed by then,
    and what the process wrote is flushed first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@contextlib.contextmanager
def interrupt_ends_the_load() -> Iterator[None]:
    """SIGINT (Ctrl-C) while the model loads takes its default action, as SIGTERM does then: the
    process ends at once (exit -2; -15 for SIGTERM), with nothing to drain yet. Python's
    KeyboardInterrupt there is raised only between bytecodes, after the native call under way,
    and was seen lost: a SmolLM2 load went on for 30 s after one, the GGUF tokenizer's build on the
    stack. From uvicorn's start the drain takes both signals and the process exits 0."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:    # ignored, or someone's own
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def server_app(args: argparse.Namespace, ae: AsyncEngine, model_dir: Path, keys: tuple[str, ...]) -> Starlette:
    """The app over `ae` as the command line configures it (its lifespan starts and drains `ae`)."""
    from .app import build_app
    from jinja2 import TemplateSyntaxError

    from .chat import ChatTemplate, load_template
    from .template_budget import TemplateLimits
    source, specials = load_template(model_dir, args.chat_template)
    try:
        limits = TemplateLimits(time_s=args.chat_template_timeout, max_chars=args.chat_template_max_chars)
        template = ChatTemplate(source, specials, limits) if source else None
    except TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse: {e.message} (line {e.lineno})") from None
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


def lifespan(ae: AsyncEngine, app: Starlette, grace_s: float
             ) -> Callable[[Any], contextlib.AbstractAsyncContextManager[None]]:
    @contextlib.asynccontextmanager
    async def run(_: Any) -> AsyncIterator[None]:
        ae.start()
        # the grammar backend warms in its worker while the server starts answering, not before:
        # xgrammar's import (transformers with it) is ~1 s of CPU, which kept `serve` from being
        # ready within 3 s; a constrained request that comes first waits for it in that worker
        warming = ae.engine.warm_grammar()
        if warming is not None:
            warming.add_done_callback(_report_broken_grammar)
        try:
            yield
        finally:
            await drain(ae, app.state.pagedecode, grace_s)
            await ae.shutdown()
    return run


def _report_broken_grammar(warming: concurrent.futures.Future[None]) -> None:
    """A broken xgrammar fails constrained requests, not the server: said once, at start."""
    error = warming.exception() if not warming.cancelled() else None
    if error is not None:
        log.error("structured output is unavailable", exc_info=error)


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
