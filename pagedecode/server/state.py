"""The server's state over one AsyncEngine: its options, the tenants, the Tracks of the requests
it started (tracks.py), the Idempotency-Key store and the metrics. What is done with it lives
beside it: admission.py lets a request in (one pipeline for every endpoint), reader.py reads
the requests an HTTP exchange holds (pins, events, acks, the disconnect policy, metering).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping

from starlette.requests import Request

from ..model.tokenizer import EscapesSpecialTokens
from ..runtime.async_engine import AsyncEngine
from ..tools import ToolFormat, detect_format
from .chat import ChatTemplate
from .errors import ApiError
from .idempotency import IdempotencyKeys
from .metrics import Metrics
from .protocol import Limits
from .tenants import Tenants
from .tracks import Track


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
    tool_format: str | None = None              # how the model writes tool calls (tools/formats.py); None: by
                                                # its chat template
    response_id_prefix: str = "resp_"           # Responses API ids: this and 128 random bits (a Ray replica's
                                                # names it, as its engine's request_id_prefix does)
    lora_modules: tuple[tuple[str, str], ...] = ()   # --lora-modules: (name, folder) of each adapter loaded at start
    allow_runtime_lora: bool = False            # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (lora.py)


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
        self.tool_format: ToolFormat = detect_format(
            chat_template.source if chat_template is not None else None,
            (lambda msgs, extra: chat_template.render(msgs, extra=extra)) if chat_template is not None else None,
            options.tool_format)
        self.tenants = Tenants(list(options.api_keys) + ([options.api_key] if options.api_key is not None else []))
        tok = self.engine.tokenizer
        if chat_template is not None and not options.allow_special_tokens_in_content \
                and isinstance(tok, EscapesSpecialTokens):
            tok.escape_specials("")       # builds the escape (a tokenizer copy) now, not during a request

    @property
    def serving(self) -> bool:
        """Admitting requests: started, and not draining."""
        return not self.draining and self.async_engine.running

    def check_metrics_auth(self, request: Request) -> None:
        if not self.options.metrics_public:
            self.tenants.check(request)

    def owned(self, tenant: str, request_id: str) -> Track:
        """The tenant's request; 404 for one it did not start (another tenant's is unknown too)."""
        track = self.tracks.get(request_id)
        if track is None or track.tenant != tenant or (track.response is not None and track.response.deleted):
            raise ApiError(404, f"unknown request id {request_id!r}", param="request_id", code="request_not_found")
        return track


def state_of(request: Request) -> ServerState:
    """The ServerState of the app a request came to (build_app keeps it in app.state)."""
    state = request.app.state.pagedecode
    assert isinstance(state, ServerState)
    return state
