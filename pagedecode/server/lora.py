"""LoRA adapters over HTTP, in vLLM's shapes: a request's `model` naming a loaded adapter runs
under it; GET /v1/models lists the adapters beside the base model (`parent` the base, `root` the
adapter's folder); POST /v1/load_lora_adapter {"lora_name", "lora_path"} and
/v1/unload_lora_adapter {"lora_name"} change them at run time only when the server was started
with --allow-runtime-lora (403 otherwise). The engine keeps the adapters (Engine.load_lora): the
server names them. An unknown name is a 404 naming it; an adapter that cannot run here (shapes,
rank, modules, files) a 400 naming it, and the server serves on."""
from __future__ import annotations

import asyncio
from typing import Any, Iterable

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from ..errors import AdapterError, UnknownAdapterError
from ..lora.request import LoRARequest
from ..runtime.engine import Engine
from . import jsonbody
from .errors import ApiError
from .openai_shapes import now
from .state import state_of


def adapter_of(engine: Engine, name: str, body: object) -> LoRARequest | None:
    """The adapter a body's `model` names (None: the base model `name`, or no model field); 404
    for a name that is neither the base model nor a loaded adapter."""
    model = body.get("model") if isinstance(body, dict) else None
    if model in (None, name):
        return None
    for adapter in engine.lora_adapters():
        if adapter.name == model:
            return LoRARequest(adapter.name, adapter.path)
    known = [name] + [a.name for a in engine.lora_adapters()]
    raise ApiError(404, f"model {model!r} is not served here: neither the base model nor a loaded LoRA adapter "
                        f"(try one of {', '.join(map(repr, known))})", param="model", code="model_not_found")


def model_cards(engine: Engine, name: str) -> list[dict[str, Any]]:
    """/v1/models' entries: the base model `name`, then each adapter with its parent and root."""
    created = now()
    base = {"id": name, "object": "model", "created": created, "owned_by": "pagedecode", "root": name,
            "parent": None, "max_model_len": engine.max_context}
    return [base] + [{"id": a.name, "object": "model", "created": created, "owned_by": "pagedecode",
                      "root": str(a.path), "parent": name, "max_model_len": engine.max_context}
                     for a in engine.lora_adapters()]


def load_modules(engine: Engine, modules: Iterable[tuple[str, str]]) -> None:
    """--lora-modules NAME=PATH ...: each loaded (and checked) before the server answers."""
    for name, path in modules:
        engine.load_lora(LoRARequest(name, path))


async def _runtime_body(request: Request, fields: tuple[str, ...]) -> dict[str, str]:
    state = state_of(request)
    state.tenants.check(request)
    if not state.options.allow_runtime_lora:
        raise ApiError(403, "loading and unloading LoRA adapters at run time is off (start the server with "
                            "--allow-runtime-lora)", code="forbidden", type_="permission_error")
    raw = await request.body()
    if len(raw) > state.options.max_body_bytes:
        raise ApiError(413, f"request body over {state.options.max_body_bytes} bytes")
    body = jsonbody.load(raw)
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_value")
    for f in fields:
        if not isinstance(body.get(f), str) or not body[f]:
            raise ApiError(400, f"{f}: a non-empty string is required", param=f, code="invalid_value")
    return {f: body[f] for f in fields}


async def load_lora_adapter(request: Request) -> Response:
    body = await _runtime_body(request, ("lora_name", "lora_path"))
    state = state_of(request)
    name = body["lora_name"]
    if name == state.options.model_name or any(a.name == name for a in state.engine.lora_adapters()):
        raise ApiError(400, f"LoRA adapter {name!r} is already loaded (or names the base model)",
                       param="lora_name", code="invalid_value")
    try:        # reading and checking the files: off the event loop
        await asyncio.to_thread(state.engine.load_lora, LoRARequest(name, body["lora_path"]))
    except AdapterError as e:
        raise ApiError(400, str(e), param="lora_path", code="invalid_value") from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    body = await _runtime_body(request, ("lora_name",))
    try:
        state_of(request).engine.unload_lora(body["lora_name"])
    except UnknownAdapterError as e:
        raise ApiError(404, str(e), param="lora_name", code="model_not_found") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")


async def models(request: Request) -> Response:
    state = state_of(request)
    state.tenants.check(request)
    return JSONResponse({"object": "list", "data": model_cards(state.engine, state.options.model_name)})


ROUTES = [Route("/v1/models", models), Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
          Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"])]
