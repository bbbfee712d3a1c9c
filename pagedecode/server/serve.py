"""The `pagedecode serve` command: load a model, start uvicorn, drain gracefully on SIGINT/SIGTERM."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
from dataclasses import fields
from pathlib import Path
from typing import Any, AsyncIterator

from ..runtime.config import EngineConfig

log = logging.getLogger("pagedecode.server")
ENGINE_FLAGS = [f for f in fields(EngineConfig) if f.name not in ("model_name",)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="Hugging Face model directory (default: the built-in tiny Llama)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (loopback unless told otherwise)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (0: any free port)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the folder name)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default=None, choices=[None, "float32", "bfloat16", "float16"], help="weights dtype")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks the model is sharded over (processes started by the engine)")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file (default: the model's)")
    p.add_argument("--max-queued-requests", type=int, default=256, help="waiting requests before 429")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (413 beyond)")
    p.add_argument("--max-request-seconds", type=float, default=None, help="cap on timeout and first_token_timeout")
    p.add_argument("--max-tokens-cap", type=int, default=4096, help="largest max_tokens a request may ask")
    p.add_argument("--grace-seconds", type=float, default=10.0, help="on shutdown, how long live requests may finish")
    p.add_argument("--log-text", action="store_true", help="include output text in the per-request log line")
    p.add_argument("--resume-grace", type=float, default=0.0,
                   help="seconds a disconnected stream waits for a client to resume it before it is cancelled")
    p.add_argument("--on-disconnect", default="cancel", choices=["cancel", "continue"],
                   help="what a client going away does to its request (a request's on_disconnect field overrides)")
    p.add_argument("--idempotency-ttl", type=float, default=600.0, help="seconds an Idempotency-Key is kept")
    p.add_argument("--idempotency-max-keys", type=int, default=10_000, help="most Idempotency-Keys kept")
    for f in ENGINE_FLAGS:
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        kind: Any = type(default) if default is not None else None
        if isinstance(default, bool):
            kind = _bool
        if f.name in ("max_cache_tokens", "memory_budget_bytes", "max_context", "seed", "max_finished_bytes"):
            kind = int
        p.add_argument(flag, type=kind, default=default, dest="engine_" + f.name, metavar=f.name.upper(),
                       help=f"EngineConfig.{f.name}")


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def main(argv: list[str] | None = None, parsed: argparse.Namespace | None = None) -> int:
    import uvicorn

    import pagedecode as pd

    from .app import build_app
    from .chat import ChatTemplate, load_template
    from .protocol import Limits
    if parsed is None:
        ap = argparse.ArgumentParser(prog="pagedecode serve", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        add_arguments(ap)
        parsed = ap.parse_args(argv)
    args = parsed
    from ..model.default_model import default_model_path
    model_dir = Path(args.model) if args.model else default_model_path()
    options = {f.name: getattr(args, "engine_" + f.name) for f in ENGINE_FLAGS}
    name = args.served_model_name or model_dir.name
    engine = pd.Engine.from_pretrained(model_dir, device=args.device, dtype=args.dtype, model_name=name,
                                       tensor_parallel_size=args.tensor_parallel_size, **options)
    source, specials = load_template(model_dir, args.chat_template)
    template = ChatTemplate(source, specials) if source else None
    defaults = generation_defaults(model_dir)
    ae = pd.AsyncEngine(engine)
    app = build_app(ae, model_name=name, chat_template=template, api_key=args.api_key,
                    limits=Limits(max_tokens=args.max_tokens_cap, max_request_seconds=args.max_request_seconds),
                    max_queued_requests=args.max_queued_requests, max_body_bytes=args.max_body_bytes,
                    generation_defaults=defaults, log_text=args.log_text, resume_grace_s=args.resume_grace,
                    on_disconnect=args.on_disconnect, idempotency_ttl_s=args.idempotency_ttl,
                    idempotency_max_keys=args.idempotency_max_keys)
    app.router.lifespan_context = lifespan(ae, app, args.grace_seconds)
    pd.freeze_heap()          # torch's heap out of every full GC pass (runtime/heap.py)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=args.grace_seconds)
    return 0


def lifespan(ae: Any, app: Any, grace_s: float) -> Any:
    @contextlib.asynccontextmanager
    async def run(_: Any) -> AsyncIterator[None]:
        ae.start()
        try:
            yield
        finally:
            await drain(ae, app.state.pagedecode, grace_s)
    return run


async def drain(ae: Any, state: Any, grace_s: float) -> None:
    """Stop admitting; let live requests finish up to grace_s; cancel the rest (each ends once)."""
    state.draining = True
    loop = asyncio.get_running_loop()
    end = loop.time() + grace_s
    while ae.engine.has_unfinished() and loop.time() < end:
        await asyncio.sleep(0.05)
    await ae.shutdown()


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
