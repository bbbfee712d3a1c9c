"""A Track: the server's record of one request it started (arrival, first token, retries,
resumes, the clients reading it now) and what answering it needs from its body (Reply).

Every request the server starts has a Track, kept with the engine's record of the request (its
attachment) and dropped with it: ServerState.tracks maps ids to Tracks weakly, so the server
keeps a Track exactly as long as the engine keeps the request (within max_finished_kept /
max_finished_bytes, which count it), and never the request's body or messages. Only a Reader
(reader.py) attaches and detaches a client.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..tools import ToolFormat
from .protocol import Parsed

if TYPE_CHECKING:
    from .responses_input import StoredResponse

TRACK_BYTES = 500          # the Track (~320 bytes) and its entry in `tracks`


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
    tool_format: ToolFormat | None = None   # the output's tool calls are parsed in this format (None: no tools)

    @classmethod
    def of(cls, parsed: Parsed) -> "Reply":
        return cls(parsed.include_usage, parsed.params.logprobs is not None, parsed.top_logprobs,
                   parsed.on_disconnect, None, parsed.prompt_logprobs, parsed.tool_format)


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
    response: StoredResponse | None = None   # a /v1/responses request's own fields (responses_input.py)
    adapter: str | None = None               # the LoRA adapter its `model` named (None: the base model)

    def kept_bytes(self) -> int:
        """What a Track adds to its finished request (tests/server/test_memory_http.py measures it)."""
        return TRACK_BYTES + (self.response.kept_bytes() if self.response is not None else 0) + (
            len(self.reply.echo) if self.reply.echo is not None else 0)

    def attach(self) -> None:
        """A client reads it now: a disconnect's grace period (if one runs) is over."""
        self.attached += 1
        if self.grace_task is not None:
            self.grace_task.cancel()
            self.grace_task = None

    def detach(self) -> None:
        """That client reads it no more (reader.py then decides what its going away means)."""
        self.attached -= 1
