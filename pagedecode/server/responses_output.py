"""The Responses API's response object and its stream, a pure function of the request's engine
events:

    engine event        response events (numbered 0, 1, ... in this order)
    start               response.created, response.in_progress, response.output_item.added,
                        response.content_part.added
    delta (with text)   response.output_text.delta
    terminal            response.output_text.done, response.content_part.done,
                        response.output_item.done, response.<completed|incomplete|failed|cancelled>

so a stream resumed after sequence number N (GET ?stream=true&starting_after=N) recomputes the
list from the request's history and sends what follows N, then follows it live: no gap, no
duplicate, whether the response is running or finished.
"""
from __future__ import annotations

import json
from typing import Any, AsyncIterator

from ..runtime.events import DeltaEvent, Event, TerminalEvent
from ..runtime.result import RequestOutput
from ..runtime.lifecycle import FinishReason, RequestState
from .responses import reason_name
from .state import ServerState
from .tracks import Track

INCOMPLETE = {FinishReason.MAX_OUTPUT_TOKENS: "max_output_tokens", FinishReason.CONTEXT_LIMIT: "max_output_tokens"}
STARTING = (RequestState.CREATED, RequestState.QUEUED)


# -- response objects -----------------------------------------------------------------------------
def status_of(out: RequestOutput) -> str:
    if not out.state.terminal:
        return "queued" if out.state in STARTING else "in_progress"
    if out.state == RequestState.CANCELLED:
        return "cancelled"
    if out.finish_reason in INCOMPLETE:
        return "incomplete"
    if out.error or out.state == RequestState.FAILED:
        return "failed"
    if out.finish_reason in (FinishReason.EOS, FinishReason.STOP_SEQUENCE, FinishReason.GRAMMAR_COMPLETE):
        return "completed"
    return "incomplete"                   # ended early without an error (a deadline)


def message_item(rid: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": "msg_" + rid.removeprefix("resp_"), "status": status, "role": "assistant",
            "content": [output_text(text)]}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def item_status(status: str) -> str:
    return {"completed": "completed", "queued": "in_progress", "in_progress": "in_progress"}.get(status, "incomplete")


def response_body(state: ServerState, track: Track, status: str, out: RequestOutput | None) -> dict[str, Any]:
    """The response object: a snapshot without output (out None: the stream's opening events),
    or as the request stands (terminal: final, with usage)."""
    meta = track.response
    assert meta is not None
    rid = track.request_id
    output: list[dict[str, Any]] = []
    if out is not None and (out.state.terminal or out.text):
        output.append(message_item(rid, out.text, item_status(status)))
    return {"id": rid, "object": "response", "created_at": track.created, "status": status,
            "background": meta.background, "error": _error(status, out), "incomplete_details": _incomplete(status, out),
            "instructions": meta.instructions, "max_output_tokens": meta.max_output_tokens,
            "metadata": meta.metadata, "model": state.options.model_name, "output": output,
            "parallel_tool_calls": False, "previous_response_id": None, "reasoning": None, "store": meta.store,
            "temperature": meta.temperature, "text": meta.text, "tool_choice": meta.tool_choice, "tools": [],
            "top_p": meta.top_p, "truncation": "disabled",
            "usage": _usage(out) if out is not None and out.state.terminal else None}


def _usage(out: RequestOutput) -> dict[str, Any]:
    u = out.usage
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": u.returned_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.returned_tokens}


def _error(status: str, out: RequestOutput | None) -> dict[str, Any] | None:
    if out is None or status != "failed":
        return None
    return {"code": "server_error", "message": out.error or reason_name(out.finish_reason) or "the response failed"}


def _incomplete(status: str, out: RequestOutput | None) -> dict[str, Any] | None:
    if out is None or status != "incomplete":
        return None
    return {"reason": INCOMPLETE.get(out.finish_reason) if out.finish_reason in INCOMPLETE
            else reason_name(out.finish_reason)}


class StreamEvents:
    """The response events one engine event makes (see the module doc), without their numbers."""

    def __init__(self, state: ServerState, track: Track) -> None:
        self.state, self.track = state, track
        self.opened = False
        self.item_id = "msg_" + track.request_id.removeprefix("resp_")

    def of(self, ev: Event) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if not self.opened:
            self.opened = True
            events += self.opening()
        if isinstance(ev, DeltaEvent) and ev.text:
            events.append({"type": "response.output_text.delta", "item_id": self.item_id, "output_index": 0,
                           "content_index": 0, "delta": ev.text, "logprobs": []})
        elif isinstance(ev, TerminalEvent):
            events += self.closing()
        return events

    def opening(self) -> list[dict[str, Any]]:
        first = "queued" if self.track.response is not None and self.track.response.background else "in_progress"
        return [{"type": "response.created", "response": response_body(self.state, self.track, first, None)},
                {"type": "response.in_progress",
                 "response": response_body(self.state, self.track, "in_progress", None)},
                {"type": "response.output_item.added", "output_index": 0,
                 "item": {**message_item(self.track.request_id, "", "in_progress"), "content": []}},
                {"type": "response.content_part.added", "item_id": self.item_id, "output_index": 0,
                 "content_index": 0, "part": output_text("")}]

    def closing(self) -> list[dict[str, Any]]:
        out = self.state.engine.result(self.track.request_id)       # terminal: it no longer changes
        status = status_of(out)
        final = response_body(self.state, self.track, status, out)
        return [{"type": "response.output_text.done", "item_id": self.item_id, "output_index": 0,
                 "content_index": 0, "text": out.text, "logprobs": []},
                {"type": "response.content_part.done", "item_id": self.item_id, "output_index": 0,
                 "content_index": 0, "part": output_text(out.text)},
                {"type": "response.output_item.done", "output_index": 0, "item": final["output"][0]},
                {"type": f"response.{status}", "response": final}]


def frame(event: dict[str, Any], seq: int) -> str:
    data = {"type": event["type"], "sequence_number": seq, **event}
    return f"event: {event['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def response_sse(state: ServerState, track: Track, after: int | None) -> AsyncIterator[str]:
    """The response's events numbered after `after` (None: all), live to the end. Holds a pin
    (taken by the caller) until it ends; a client that goes away is a disconnect (its policy)."""
    rid = track.request_id
    track.attach()
    ended = False
    seen = -1 if after is None else after          # the last number the client has
    try:
        events, n = StreamEvents(state, track), 0
        async for ev in state.async_engine.follow(rid, -1):
            items = events.of(ev)
            if n + len(items) - 1 > seen:       # some of them are new to this client
                state.seen(track, ev)
            for item in items:
                if n > seen:
                    yield frame(item, n)
                n += 1
            state.engine.ack(rid, ev.seq)          # sent: the request may run on (backpressure)
            ended = isinstance(ev, TerminalEvent)
    finally:
        track.attached -= 1
        if not ended:
            state.detached(track)
        state.engine.unpin(rid)
