"""A replica: one engine, the server's own ASGI app over it (see pagedecode/ray/__init__.py)."""
from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, MutableMapping

if TYPE_CHECKING:
    from .app import Spec

log = logging.getLogger("pagedecode.ray")


class EngineReplica:
    def __init__(self, index: int, spec: Spec) -> None:
        import torch

        import pagedecode as pd

        from ..server.app import build_app as build_asgi
        from ..server.chat import ChatTemplate, load_template
        from ..server.serve import generation_defaults
        if spec.torch_threads:
            torch.set_num_threads(spec.torch_threads)
        self.index, self.name = index, f"replica-{index}"
        self.spec = spec
        engine = pd.Engine.from_pretrained(spec.model, model_name=spec.served_model_name,
                                           request_id_prefix=f"req-r{index}-", **spec.load,
                                           **{"num_threads": spec.torch_threads, **spec.engine})
        source, specials = load_template(spec.model, spec.chat_template)
        self.template = (source, specials)
        self.ae = pd.AsyncEngine(engine)
        self.app = build_asgi(self.ae, model_name=spec.served_model_name,
                              chat_template=ChatTemplate(source, specials) if source else None,
                              generation_defaults=generation_defaults(Path(spec.model)),
                              response_id_prefix=f"resp_r{index}-", **spec.server)
        self.state = self.app.state.pagedecode
        self._started: asyncio.Future[None] | None = None
        self.publisher = None
        if spec.kv_events is not None:
            from ..kv_events import KVEventPublisher, binds, default_replay, offset_port
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
        """What the router keys prompts with: the tokenizer, the chat template and its tool format,
        the page size, and whether chat content's special-token text is the real token."""
        return {"tokenizer": self.ae.engine.tokenizer, "template": self.template,
                "tool_format": self.state.tool_format.name, "page_size": self.ae.engine.config.page_size,
                "allow_special_tokens_in_content": self.state.options.allow_special_tokens_in_content}

    async def check_health(self) -> None:
        if self._started is not None and self._started.done() and not self.ae.running:
            raise RuntimeError(f"{self.name}: the step loop stopped")

    async def __del__(self) -> None:
        """Serve's graceful shutdown: drain, then stop the engine."""
        from ..server.serve import drain
        try:
            if self._started is not None and self._started.done():
                await drain(self.ae, self.state, self.spec.grace_s)
                await self.ae.shutdown()
        finally:
            self.ae.engine.close()
            if self.publisher is not None:
                self.publisher.close()


