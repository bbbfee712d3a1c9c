"""Anthropic's Messages API shapes: requests convert to chat requests the tools package reads;
replies and streamed events validate against the official `anthropic` client's types, and the
client's own accumulator folds the events into the non-streamed reply, over any chunking."""
import itertools
import json

import pytest

from pagedecode.errors import InvalidFieldError
from pagedecode.server import anthropic_shapes as shapes
from pagedecode.tools import HERMES, ToolStreamParser, parse_tool_fields, parse_tool_output, prepare_messages

anthropic = pytest.importorskip("anthropic")
from anthropic.lib.streaming._messages import accumulate_event  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

EVENT = TypeAdapter(anthropic.types.RawMessageStreamEvent)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
REQUEST = {
    "model": "m", "max_tokens": 64, "system": [{"type": "text", "text": "Be brief."}],
    "stop_sequences": ["END"], "temperature": 0.5, "top_p": 0.9, "top_k": 40, "metadata": {"user_id": "u1"},
    "tools": [{"name": "get_weather", "description": "Weather now", "input_schema": SCHEMA}],
    "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "18C"}]},
                                     {"type": "text", "text": "And tomorrow?"}]},
    ]}


def test_a_messages_request_becomes_a_chat_request():
    chat = shapes.chat_request(REQUEST)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18C"},
        {"role": "user", "content": "And tomorrow?"}]
    assert (chat["max_tokens"], chat["stop"], chat["temperature"], chat["top_p"], chat["top_k"], chat["user"]) == \
        (64, ["END"], 0.5, 0.9, 40, "u1")
    spec = parse_tool_fields(chat)
    assert spec.mode == "required" and not spec.parallel and spec.tools[0].parameters == SCHEMA
    assert prepare_messages(chat["messages"], spec, HERMES)[2]["tool_calls"][0]["function"]["arguments"] == \
        {"city": "Paris"}


@pytest.mark.parametrize("choice, want", [
    ({"type": "auto"}, {"tool_choice": "auto"}), ({"type": "none"}, {"tool_choice": "none"}),
    ({"type": "tool", "name": "f"}, {"tool_choice": {"type": "function", "function": {"name": "f"}}}),
])
def test_tool_choices(choice, want):
    assert {k: v for k, v in shapes.chat_request({**REQUEST, "tool_choice": choice}).items()
            if k in ("tool_choice", "parallel_tool_calls")} == want


@pytest.mark.parametrize("change, field", [
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b"}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "messages[0].content[0].tool_use_id"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
])
def test_refusals_name_the_field(change, field):
    with pytest.raises(InvalidFieldError) as e:
        shapes.chat_request({**REQUEST, **change})
    assert e.value.field == field


def counter():
    n = itertools.count()
    return lambda: f"call_{next(n)}"


TEXTS = [("Hello there.", "eos", "end_turn"),
         ("Let me look. " + HERMES.write([("get_weather", '{"city": "Paris \\"}"}'), ("get_weather", '{"city": "Rome"}')]),
          "grammar_complete", "tool_use"),
         ("cut " + HERMES.write([("get_weather", '{"city": "Pa')])[:-20], "max_output_tokens", "max_tokens"),
         ("said END", "stop_sequence", "stop_sequence")]


@pytest.mark.parametrize("text, reason, want", TEXTS)
def test_replies_validate_against_the_client_types(text, reason, want):
    output = parse_tool_output(text, HERMES, counter())
    reply = shapes.message("msg_1", "m", output, reason, "END", 10, 20)
    parsed = anthropic.types.Message.model_validate(reply)
    assert parsed.stop_reason == want
    assert parsed.stop_sequence == ("END" if want == "stop_sequence" else None)
    if want == "tool_use":
        assert [b.type for b in parsed.content] == ["text", "tool_use", "tool_use"]
        assert parsed.content[1].input == {"city": 'Paris "}'}


@pytest.mark.parametrize("text, reason, want", TEXTS)
@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_streamed_events_fold_into_the_reply_in_the_client(text, reason, want, size):
    parser = ToolStreamParser(HERMES, counter())
    events = shapes.MessageEvents("msg_1", "m", 10)
    out = events.start()
    for i in range(0, len(text), size):
        out += events.feed(parser.feed(text[i:i + size]))
    out += events.feed(parser.finish())
    out += events.finish(reason, parser.output, "END", 20)
    snapshot, json_bufs = None, {}
    for ev in out:
        snapshot = accumulate_event(event=EVENT.validate_python(ev), current_snapshot=snapshot, json_bufs=json_bufs)
    whole = shapes.message("msg_1", "m", parse_tool_output(text, HERMES, counter()), reason, "END", 10, 20)
    got = snapshot.model_dump(exclude_none=True)
    assert [{k: b[k] for k in ("type", "text", "id", "name", "input") if k in b} for b in got["content"]] == \
        whole["content"]
    assert got["stop_reason"] == whole["stop_reason"] == want
    assert got["usage"]["output_tokens"] == 20 and got["usage"]["input_tokens"] == 10
    kinds = [e["type"] for e in out]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == len(whole["content"])


def test_sse_text_and_ping_and_errors():
    assert shapes.sse(shapes.PING) == 'event: ping\ndata: {"type": "ping"}\n\n'
    body = shapes.error(400, "bad max_tokens")
    assert body == {"type": "error", "error": {"type": "invalid_request_error", "message": "bad max_tokens"}}
    assert shapes.error(401, "x")["error"]["type"] == "authentication_error"
    assert shapes.error(529, "x")["error"]["type"] == "overloaded_error"
    assert shapes.error(500, "x")["error"]["type"] == "api_error"
    anthropic.types.ErrorResponse.model_validate(body)
    json.dumps(body)
