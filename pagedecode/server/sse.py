"""Completions and chat answered as server-sent events (the request's `stream: true`).

One choice: every chunk carries an SSE id, so a client that reconnects with Last-Event-ID (or
GET /v1/requests/{id}/events) gets what follows, byte-identical: the chat role chunk carries
its start event's seq (0), content chunks their delta's seq, the finish (or error) chunk the
terminal event's seq T, the usage chunk (include_usage) T + 1; so a resume after T sends the
usage chunk and [DONE], after T + 1 only [DONE]. Chunks are built from what the request kept
(`created` is the request's): the chunk builders are pure functions of the track, its events
and its result.

Several choices (a batch of prompts, n > 1, or both) share one stream without ids (their events
have no one order to resume after): `choices_sse`.

Each stream reads its requests through the Reader it is given (reader.py), which holds them
until the stream ends and applies the disconnect policy to a client that goes away.
"""
from __future__ import annotations

from contextlib import aclosing
from typing import Any, AsyncIterator

from starlette.requests import Request

from ..runtime.engine import Engine
from ..runtime.output.events import DeltaEvent, TerminalEvent
from ..runtime.output.result import RequestOutput
from ..runtime.lifecycle import FinishReason, RequestState
from .integers import parse_decimal
from .errors import ApiError
from .openai_shapes import chunk_body, finish_fields, logprobs_body, reason_name, sse, sum_usage, usage_body
from .reader import Reader
from .tool_calls import ToolChoiceStream
from .tracks import Track

FAILURES = (FinishReason.MODEL_ERROR, FinishReason.CONTENT_INTERRUPTED, FinishReason.TRANSPORT_ERROR)
DONE = "data: [DONE]\n\n"


def cursor(after: int | None) -> int:
    """The engine's cursor for "after SSE id `after`" (None: from the start)."""
    return -1 if after is None else after


def before(after: int | None, seq: int) -> bool:
    """Whether the event `seq` comes after what the client has seen."""
    return after is None or after < seq


# -- resuming -------------------------------------------------------------------------------------
def last_event_id(request: Request) -> int | None:
    """Last-Event-ID (or ?after=): resume after that SSE id; None (absent, or -1) is from the start."""
    header = request.headers.get("last-event-id")
    name, value = ("Last-Event-ID", header) if header else ("after", request.query_params.get("after"))
    if value is None:
        return None
    after = parse_decimal(value)
    if after is None:
        raise ApiError(400, f"{name} must be an event id (an integer >= -1), got {value!r}", param=name)
    if after < -1:
        raise ApiError(400, f"{name} must be an event id (an integer >= -1), got {after}", param=name)
    return None if after == -1 else after


def sse_ids(engine: Engine, track: Track) -> tuple[int, int | None]:
    """The newest SSE id the request's stream has so far, and its terminal event's seq (None
    while live). Ids are event seqs; the usage chunk, after the terminal event, is terminal + 1."""
    newest, ended = engine.newest_event(track.request_id)
    if not ended:
        return newest, None
    return newest + (1 if track.reply.include_usage else 0), newest


def check_resume(reader: Reader, track: Track, after: int | None) -> None:
    """An id no chunk has carried yet cannot have been seen: 400 (the reader's pins released)."""
    last, _ = sse_ids(reader.engine, track)
    if after is not None and after > last:
        reader.release()
        raise ApiError(400, f"Last-Event-ID {after} is beyond the last event of request {track.request_id!r} "
                            f"(id {last})", param="Last-Event-ID", code="event_id_out_of_range")


# -- chunks ---------------------------------------------------------------------------------------
def ends_in_error(out: RequestOutput) -> bool:
    """Whether a stream ends in an error chunk: a failure reason, or any request that FAILED with
    an error (a deadline before the first token: the non-streaming answer's pagedecode_error)."""
    return bool(out.error) and (out.finish_reason in FAILURES or out.state == RequestState.FAILED)


def finish_chunk(out: RequestOutput, head: dict[str, Any], chat: bool, index: int, seq: int | None,
                 tools: ToolChoiceStream | None = None) -> str:
    """A choice's last chunk: its finish reason (with tools: the text the parser held back, and
    the reason that agrees with the calls), or the error it failed with."""
    if ends_in_error(out):
        return sse({"error": {"message": out.error, "type": "server_error", "param": None,
                              "code": reason_name(out.finish_reason)}}, seq)
    fin: dict[str, Any] = {"index": index, **finish_fields(out), "logprobs": None}
    if tools is not None:
        fin["delta"] = tools.finish()
        fin["finish_reason"] = tools.finish_reason(fin["finish_reason"])
    elif chat:
        fin["delta"] = {}
    else:
        fin["text"] = ""
    return sse({**head, "choices": [fin]}, seq)


def head_of(track: Track, model_name: str) -> dict[str, Any]:
    """The fields every chunk of a request's stream opens with."""
    return {"id": track.request_id, "object": "chat.completion.chunk" if track.chat else "text_completion",
            "created": track.created, "model": model_name}


def delta_chunk(tokenizer: Any, head: dict[str, Any], track: Track, ev: DeltaEvent, index: int,
                sent_chars: int, tools: ToolChoiceStream | None = None) -> dict[str, Any] | None:
    """The chunk of one delta event; with tools, its delta is what the parser made known (None:
    nothing yet, and no logprobs to send)."""
    chunk = chunk_body(head["id"], head["object"], head["created"], head["model"], track.chat, ev.text, index)
    if tools is not None:
        chunk["choices"][0]["delta"] = tools.feed(ev.text)
        if not chunk["choices"][0]["delta"] and ev.logprobs is None:
            return None
    if ev.logprobs is not None:
        chunk["choices"][0]["logprobs"] = logprobs_body(tokenizer, ev, track.chat, track.reply.top_logprobs,
                                                        sent_chars)
    return chunk


def tool_stream(reader: Reader, track: Track, after: int | None) -> ToolChoiceStream | None:
    """A tool-calling choice's parser, fed what a resumed client already has (so what follows
    is what the first stream sent)."""
    fmt = track.reply.tool_format
    if fmt is None:
        return None
    tools = ToolChoiceStream(fmt, track.request_id)
    if after is not None:
        for e in reader.history(track):
            if isinstance(e, DeltaEvent) and e.seq <= after:
                tools.feed(e.text)
    return tools


def role_chunk(head: dict[str, Any], index: int) -> dict[str, Any]:
    return {**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}]}


# -- one choice -----------------------------------------------------------------------------------
def sent_chars_before(reader: Reader, track: Track, after: int | None) -> int:
    """The text a resumed completions stream with logprobs has sent (its text_offset goes on)."""
    if after is None or track.chat or not track.reply.logprobs:
        return 0
    return sum(len(e.text) for e in reader.history(track) if isinstance(e, DeltaEvent) and e.seq <= after)


async def one_sse(reader: Reader, track: Track, after: int | None) -> AsyncIterator[str]:
    """SSE from the request's events after SSE id `after` (None: all), then [DONE]."""
    async with reader:
        head = head_of(track, reader.model_name)
        sent_chars = sent_chars_before(reader, track, after)
        tools = tool_stream(reader, track, after)
        if track.chat and after is None:
            yield sse(role_chunk(head, 0), 0)
        async for ev in reader.events(track, cursor(after)):
            if isinstance(ev, DeltaEvent):
                chunk = delta_chunk(reader.tokenizer, head, track, ev, 0, sent_chars, tools)
                if chunk is not None:
                    yield sse(chunk, ev.seq)
                sent_chars += len(ev.text)
        _, terminal = sse_ids(reader.engine, track)
        assert terminal is not None
        out = reader.result(track)
        if before(after, terminal):
            yield finish_chunk(out, head, track.chat, 0, terminal, tools)
        if track.reply.include_usage and before(after, terminal + 1):
            yield sse({**head, "choices": [], "usage": usage_body(out.usage)}, terminal + 1)
        yield DONE


# -- several choices ------------------------------------------------------------------------------
async def choices_sse(reader: Reader, n: int) -> AsyncIterator[str]:
    """One SSE stream of the reader's choices, prompt-major: prompt i, sample j is choice i * n + j.
    Each choice's chunks go out as its events come, carrying its index (chat: every choice's
    role chunk first); each choice's finish (or error) chunk when it ends; then one usage chunk
    summed over them (include_usage) and [DONE]. A retry with the same Idempotency-Key replays
    it from the start; each choice's own request stays readable at /v1/requests/{id}/events."""
    tracks = reader.tracks
    async with reader:
        head = head_of(tracks[0], reader.model_name)
        sent_chars = [0] * len(tracks)
        tools = [tool_stream(reader, t, None) for t in tracks]
        if tracks[0].chat:
            for i in range(len(tracks)):
                yield sse(role_chunk(head, i))
        async with aclosing(reader.merged()) as events:      # closed at once: its followers stop
            async for i, ev in events:
                track = tracks[i]
                if isinstance(ev, DeltaEvent):
                    chunk = delta_chunk(reader.tokenizer, head, track, ev, i, sent_chars[i], tools[i])
                    if chunk is not None:
                        yield sse(chunk)
                    sent_chars[i] += len(ev.text)
                elif isinstance(ev, TerminalEvent):
                    yield finish_chunk(reader.result(track), head, track.chat, i, None, tools[i])
        if tracks[0].reply.include_usage:
            yield sse({**head, "choices": [], "usage": sum_usage([reader.result(t) for t in tracks], n)})
        yield DONE
