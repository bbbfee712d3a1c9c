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
duplicate, whether the response is running or finished. The builders are pure functions of the
track, its events and its result; response_sse reads the request through its Reader.
"""
from __future__ import annotations

import json
from typing import Any, AsyncIterator

from ..runtime.output.events import DeltaEvent, Event, TerminalEvent
from ..runtime.output.result import RequestOutput
from ..runtime.lifecycle import FinishReason, RequestState
from .openai_shapes import reason_name
from .reader import Reader
from .responses_tools import ToolItemEvents, message_item, output_items, output_text
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


def item_status(status: str) -> str:
    return {"completed": "completed", "queued": "in_progress", "in_progress": "in_progress"}.get(status, "incomplete")


def response_body(track: Track, model_name: str, status: str, out: RequestOutput | None) -> dict[str, Any]:
    """The response object: a snapshot without output (out None: the stream's opening events),
    or as the request stands (terminal: final, with usage)."""
    meta = track.response
    assert meta is not None
    rid = track.request_id
    output: list[dict[str, Any]] = []
    fmt = track.reply.tool_format
    if out is not None and (out.state.terminal or out.text):
        output = [message_item(rid, out.text, item_status(status))] if fmt is None else \
            output_items(rid, out.text, fmt, item_status(status))
    return {"id": rid, "object": "response", "created_at": track.created, "status": status,
            "background": meta.background, "error": _error(status, out), "incomplete_details": _incomplete(status, out),
            "instructions": meta.instructions, "max_output_tokens": meta.max_output_tokens,
            "metadata": meta.metadata, "model": model_name, "output": output,
            "parallel_tool_calls": meta.parallel_tool_calls, "previous_response_id": None, "reasoning": None, "store": meta.store,
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


def stream_events(track: Track, model_name: str, ev: Event, out: RequestOutput | None,
                  items: ToolItemEvents | None = None) -> list[dict[str, Any]]:
    """The response events one engine event makes (see the module doc), without their numbers;
    out is the request's result, for its terminal event. A tool-calling response's items come
    from `items` (responses_tools.py), fed every event in order."""
    item_id = "msg_" + track.request_id.removeprefix("resp_")
    if items is not None:
        return _tool_events(track, model_name, ev, out, items)
    events = _opening(track, model_name, item_id) if ev.seq == 0 else []     # seq 0: the start event
    if isinstance(ev, DeltaEvent) and ev.text:
        events.append({"type": "response.output_text.delta", "item_id": item_id, "output_index": 0,
                       "content_index": 0, "delta": ev.text, "logprobs": []})
    elif isinstance(ev, TerminalEvent):
        assert out is not None
        events += _closing(track, model_name, item_id, out)
    return events


def _tool_events(track: Track, model_name: str, ev: Event, out: RequestOutput | None, items: ToolItemEvents
                 ) -> list[dict[str, Any]]:
    events = _opening(track, model_name, "")[:2] if ev.seq == 0 else []     # its items open as they come
    if isinstance(ev, DeltaEvent) and ev.text:
        events += items.feed(ev.text)
    elif isinstance(ev, TerminalEvent):
        assert out is not None
        status = status_of(out)
        events += items.feed(None) + [{"type": f"response.{status}",
                                       "response": response_body(track, model_name, status, out)}]
    return events


def _opening(track: Track, model_name: str, item_id: str) -> list[dict[str, Any]]:
    first = "queued" if track.response is not None and track.response.background else "in_progress"
    return [{"type": "response.created", "response": response_body(track, model_name, first, None)},
            {"type": "response.in_progress", "response": response_body(track, model_name, "in_progress", None)},
            {"type": "response.output_item.added", "output_index": 0,
             "item": {**message_item(track.request_id, "", "in_progress"), "content": []}},
            {"type": "response.content_part.added", "item_id": item_id, "output_index": 0,
             "content_index": 0, "part": output_text("")}]


def _closing(track: Track, model_name: str, item_id: str, out: RequestOutput) -> list[dict[str, Any]]:
    status = status_of(out)
    final = response_body(track, model_name, status, out)
    return [{"type": "response.output_text.done", "item_id": item_id, "output_index": 0,
             "content_index": 0, "text": out.text, "logprobs": []},
            {"type": "response.content_part.done", "item_id": item_id, "output_index": 0,
             "content_index": 0, "part": output_text(out.text)},
            {"type": "response.output_item.done", "output_index": 0, "item": final["output"][0]},
            {"type": f"response.{status}", "response": final}]


def frame(event: dict[str, Any], seq: int) -> str:
    data = {"type": event["type"], "sequence_number": seq, **event}
    return f"event: {event['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def response_sse(reader: Reader, track: Track, after: int | None) -> AsyncIterator[str]:
    """The response's events numbered after `after` (None: all), live to the end."""
    fmt = track.reply.tool_format
    tool_items = ToolItemEvents(track.request_id, fmt) if fmt is not None else None
    made_at: dict[int, list[dict[str, Any]]] = {}     # each event's, made once (the tool items are fed once)

    def made(ev: Event) -> list[dict[str, Any]]:
        if ev.seq not in made_at:
            made_at[ev.seq] = stream_events(track, reader.model_name, ev, reader.result(track)
                                            if isinstance(ev, TerminalEvent) else None, tool_items)
        return made_at[ev.seq]
    seen = -1 if after is None else after          # the last number the client has
    async with reader:
        n, cursor = 0, -1
        for ev in reader.history(track):           # what the client has all of: numbered again, not sent
            items = made(ev)
            if n + len(items) - 1 > seen:
                break
            n, cursor = n + len(items), ev.seq
        async for ev in reader.events(track, cursor):
            for item in made(ev):
                if n > seen:
                    yield frame(item, n)
                n += 1
