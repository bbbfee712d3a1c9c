"""The Anthropic Messages API through the official `anthropic` client on a real server (the
built-in random model): messages.create, the streaming helper messages.stream, a tool loop,
count_tokens, x-api-key and Bearer for one tenant, errors in Anthropic's shape."""
import json

import httpx
import pytest

from .conftest import stop_server
from .test_tools_http import HERMES_TEMPLATE, SCHEMAS, start

anthropic = pytest.importorskip("anthropic")
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": SCHEMAS["get_weather"]}
TIME = {"name": "get_time", "input_schema": SCHEMAS["get_time"]}


@pytest.fixture(scope="module")
def server():
    s = start(HERMES_TEMPLATE, api_key="sekret")
    yield s
    stop_server(s)


@pytest.fixture()
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="sekret", max_retries=0)


SAMPLING = ("temperature", "top_p", "top_k")     # fields this client version no longer names: sent as extra_body


def split(kw):
    return {k: v for k, v in kw.items() if k not in SAMPLING}, {k: v for k, v in kw.items() if k in SAMPLING}


def create(client, **kw):
    kw, extra = split({"model": "stories260k", "max_tokens": 120, "temperature": 0.0,
                       "messages": [{"role": "user", "content": "weather?"}], **kw})
    return client.messages.create(**kw, extra_body=extra)


def test_text_message(client):
    m = create(client, system="be brief", max_tokens=5)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 5 and m.usage.input_tokens > 0
    assert [b.type for b in m.content] == ["text"]


def test_stop_sequence(client):
    # greedy (top_k / top_p taken, no effect): the second request makes the first one's text again,
    # so its stop sequence is met (sampled, the two draws differed and the stop could be missed)
    free = create(client, max_tokens=30, temperature=0.0, top_k=40, top_p=0.9, metadata={"user_id": "u1"})
    text = free.content[0].text
    stop = text[3:5]
    m = create(client, max_tokens=30, temperature=0.0, top_k=40, top_p=0.9, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_time"},
                                    {"type": "any", "disable_parallel_tool_use": True}])
def test_tool_use_parses_and_validates(client, choice):
    m = create(client, tools=[WEATHER, TIME], tool_choice=choice)
    assert m.stop_reason == "tool_use"
    [use] = [b for b in m.content if b.type == "tool_use"]
    assert use.id.startswith("toolu_")
    assert choice["type"] != "tool" or use.name == "get_time"
    jsonschema.validate(use.input, SCHEMAS[use.name])


def test_streaming_helper_equals_the_message(client):
    kw = dict(tools=[WEATHER, TIME], tool_choice={"type": "any", "disable_parallel_tool_use": True},
              temperature=1.0, top_k=50)
    kw, extra = split(kw)
    with client.messages.stream(model="stories260k", max_tokens=120, messages=[{"role": "user", "content": "w"}],
                                extra_body=extra, **kw) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and "content_block_start" in kinds and kinds[-1] == "message_stop"
    assert final.stop_reason == "tool_use"
    [use] = [b for b in final.content if b.type == "tool_use"]
    jsonschema.validate(use.input, SCHEMAS[use.name])
    with client.messages.stream(model="stories260k", max_tokens=6, messages=[{"role": "user", "content": "w"}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert final.stop_reason == "max_tokens" and final.content[0].text == text


def test_raw_events_in_order(server):
    body = {"model": "stories260k", "max_tokens": 120, "stream": True, "tools": [WEATHER],
            "tool_choice": {"type": "tool", "name": "get_weather"}, "messages": [{"role": "user", "content": "w"}]}
    r = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": "sekret"}, timeout=60)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    names = [e["type"] for e in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert events[0]["message"]["usage"]["input_tokens"] > 0 and events[0]["message"]["content"] == []
    start = next(e for e in events if e["type"] == "content_block_start" and e["content_block"]["type"] == "tool_use")
    partial = "".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"
                      and e["delta"]["type"] == "input_json_delta")
    jsonschema.validate(json.loads(partial), SCHEMAS["get_weather"])
    assert start["content_block"]["name"] == "get_weather"
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def test_tool_loop(client):
    messages = [{"role": "user", "content": "weather in Paris?"}]
    first = create(client, messages=messages, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    assert first.stop_reason == "tool_use"
    messages.append({"role": "assistant", "content": [b.model_dump() for b in first.content]})
    messages.append({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": b.id, "content": "sunny"} for b in first.content
        if b.type == "tool_use"]})
    second = create(client, messages=messages, tools=[WEATHER], tool_choice={"type": "none"}, max_tokens=8)
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert all(b.type == "text" for b in second.content)
    counted = client.messages.count_tokens(model="stories260k", messages=messages, tools=[WEATHER])
    assert counted.input_tokens > second.usage.input_tokens - 1 > 0


def test_keys_and_errors(server):
    url, body = server.url + "/v1/messages", {"model": "stories260k", "max_tokens": 4,
                                              "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(url, json=body, headers={"authorization": "Bearer sekret"}, timeout=60).status_code == 200
    r = httpx.post(url, json=body, headers={"x-api-key": "wrong"}, timeout=60)
    assert r.status_code == 401 and r.json() == {"type": "error", "error": {
        "type": "authentication_error", "message": "invalid or missing API key"}}
    for bad, field in [({"max_tokens": None}, "max_tokens"), ({"stop_sequences": 3}, "stop_sequences"),
                       ({"tools": [{"name": "f", "input_schema": {"type": "array"}}]}, "tools[0].input_schema"),
                       ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]}, "tool_choice")]:
        r = httpx.post(url, json={**body, **bad}, headers={"x-api-key": "sekret"}, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
        assert field in r.json()["error"]["message"], r.text
    client = anthropic.Anthropic(base_url=server.url, api_key="sekret", max_retries=0)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="other", max_tokens=4, messages=[{"role": "user", "content": "hi"}])


def test_idempotency_metering_and_disconnect(server):
    """The same admission and reading as every endpoint: an Idempotency-Key retry is one
    generation with the same message; each request is metered once; a stream the client
    leaves is cancelled."""
    url, h = server.url + "/v1/messages", {"x-api-key": "sekret", "Idempotency-Key": "m-1"}
    body = {"model": "stories260k", "max_tokens": 10, "temperature": 1.0, "messages": [{"role": "user", "content": "x"}]}
    before = len(server.state.tracks)
    a = httpx.post(url, json=body, headers=h, timeout=60).json()
    b = httpx.post(url, json=body, headers=h, timeout=60).json()
    assert a == b and len(server.state.tracks) == before + 1
    assert httpx.post(url, json={**body, "max_tokens": 11}, headers=h, timeout=60).status_code == 409
    assert server.state.tracks[a["id"]].metered
    long = {**body, "max_tokens": 2000, "stream": True, "messages": [{"role": "user", "content": "y"}]}
    with httpx.stream("POST", url, json=long, headers={"x-api-key": "sekret"}, timeout=60) as r:
        rid = r.headers["x-request-id"]
        for line in r.iter_lines():
            if "content_block_delta" in line:
                break
    import time
    for _ in range(200):
        out = server.engine.result(rid)
        if out.state.terminal and server.state.tracks[rid].metered:
            break
        time.sleep(0.05)
    assert out.finish_reason.value == "transport_error" and server.state.tracks[rid].metered
