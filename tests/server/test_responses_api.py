"""The Responses API (/v1/responses) driven by the official openai client and by httpx over a
real server (issue 21, item 4): the response object, the stream's events and sequence numbers,
background responses (retrieve, cancel, resume without a gap or a duplicate), structured output,
what is refused, tenants, store: false and delete."""
import json
import threading
import time

import httpx
import pytest

from .conftest import start_server, stop_server

openai = pytest.importorskip("openai")

KEY_A, KEY_B = "key-a", "key-b"
OPENING = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
CLOSING = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def server(stories_path):
    """Two tenants; `slow` set makes every step take ~10 ms more (a request that stays live)."""
    s = start_server(stories_path, api_keys=(KEY_A, KEY_B))
    real = s.engine.model.forward
    s.slow = threading.Event()

    def forward(batch, kv):
        if s.slow.is_set():
            time.sleep(0.01)
        return real(batch, kv)
    s.engine.model.forward = forward
    yield s
    stop_server(s)


@pytest.fixture()
def slow(server):
    server.slow.set()
    yield
    server.slow.clear()


def client(server, key=KEY_A):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def sse_events(raw):
    """The JSON data of each SSE frame of a Responses stream."""
    return [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]


def wait_for(predicate, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def test_create_returns_a_response_object(server):
    r = client(server).responses.create(model="stories260k", input="Once upon a time", instructions="Tell a story.",
                                        max_output_tokens=12, temperature=0, metadata={"k": "v"})
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "stories260k"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text and r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.output[0].content[0].type == "output_text" and r.output[0].content[0].annotations == []
    assert r.usage.output_tokens == 12 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + 12 and r.usage.input_tokens_details.cached_tokens >= 0
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.instructions == "Tell a story." and r.metadata == {"k": "v"} and r.max_output_tokens == 12
    assert r.temperature == 0 and r.error is None
    # the same text as chat with the same messages (input -> messages; the template drops system)
    chat = client(server).chat.completions.create(model="stories260k", max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Tell a story."}, {"role": "user", "content": "Once upon a time"}])
    assert chat.choices[0].message.content == r.output_text
    items = client(server).responses.create(model="stories260k", max_output_tokens=12, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Once upon "}, {"type": "input_text",
                                                                                  "text": "a time"}]}])
    assert items.output_text == r.output_text


def test_stream_events_in_order_with_contiguous_sequence_numbers(server):
    events = list(client(server).responses.create(model="stories260k", input="Once upon a time",
                                                  max_output_tokens=16, temperature=0, stream=True))
    types = [e.type for e in events]
    assert types[:4] == OPENING and types[-4:] == CLOSING + ["response.incomplete"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert events[-4].text == text == final.output_text and final.usage.output_tokens == 16
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert events[-2].item.id == events[2].item.id == events[4].item_id


def test_background_retrieve_and_cancel(server, slow):
    c = client(server)
    r = c.responses.create(model="stories260k", input="Once upon a time", max_output_tokens=20, background=True)
    assert r.status in ("queued", "in_progress") and r.background
    done = wait_for(lambda: (x := c.responses.retrieve(r.id)).status not in ("queued", "in_progress") and x)
    assert done.status == "incomplete" and done.usage.output_tokens == 20 and done.output_text
    long = c.responses.create(model="stories260k", input="Once", max_output_tokens=400, background=True,
                              extra_body={"ignore_eos": True})
    wait_for(lambda: c.responses.retrieve(long.id).output_text)           # running, with some text
    cancelled = c.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and 0 < cancelled.usage.output_tokens < 400
    assert c.responses.retrieve(long.id).status == "cancelled"
    events = list(c.responses.retrieve(long.id, stream=True))
    # the installed SDK has no model of response.cancelled: it parses, its `response` stays a dict
    assert events[-1].type == "response.cancelled" and events[-1].response["status"] == "cancelled"
    assert events[0].response.status == "queued" and events[-1].sequence_number == len(events) - 1


def test_resume_gives_exactly_the_remaining_events_live_and_after(server, slow):
    """A background stream read halfway, cut off, resumed with starting_after while it runs and
    again once it is over: the same events, none missing, none twice."""
    c = client(server)
    first = []
    with c.responses.create(model="stories260k", input="Once", max_output_tokens=120, background=True,
                            stream=True, extra_body={"ignore_eos": True}) as s:
        for e in s:
            first.append(e)
            if len(first) == 10:
                break                                    # the connection goes; the response goes on
    rid = first[0].response.id
    cut = first[-1].sequence_number
    assert c.responses.retrieve(rid).status in ("queued", "in_progress")       # resumed live
    rest = list(c.responses.retrieve(rid, stream=True, starting_after=cut))
    assert [e.sequence_number for e in first + rest] == list(range(len(first) + len(rest)))
    assert rest[-1].type == "response.incomplete" and rest[-1].response.usage.output_tokens == 120
    text = "".join(e.delta for e in first + rest if e.type == "response.output_text.delta")
    assert text == rest[-1].response.output_text
    whole = [e.model_dump() for e in c.responses.retrieve(rid, stream=True)]           # after the end
    assert whole == [e.model_dump() for e in first + rest]
    middle = len(whole) // 2
    assert [e.model_dump() for e in c.responses.retrieve(rid, stream=True, starting_after=middle)] == \
        whole[middle + 1:]
    assert list(c.responses.retrieve(rid, stream=True, starting_after=len(whole) - 1)) == []


def test_text_format_json_schema_gives_valid_json(server):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client(server).responses.create(model="stories260k", input="Once", max_output_tokens=60, text={
        "format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}})
    data = json.loads(r.output_text)
    assert set(data) == {"name", "age"} and 0 <= data["age"] <= 9 and r.status == "completed"
    obj = client(server).responses.create(model="stories260k", input="Once", max_output_tokens=60,
                                          text={"format": {"type": "json_object"}})
    assert obj.output_text.lstrip().startswith("{")          # a JSON object under way (a tiny model rambles)


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0]"),
    ({"input": ""}, "input"),
    ({"background": True, "store": False}, "background"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "schema": 3}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text.format"),
    ({"metadata": {"k": 1}}, "metadata"),
    ({"frobnicate": 1}, "frobnicate"),
])
def test_unsupported_and_invalid_fields_are_400_naming_them(server, extra, param):
    body = {"model": "stories260k", "input": "Once", "max_output_tokens": 4, **extra}
    r = httpx.post(server.url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"]


def test_tenants_store_false_and_delete(server):
    a, b = client(server, KEY_A), client(server, KEY_B)
    r = a.responses.create(model="stories260k", input="Once", max_output_tokens=4)
    assert a.responses.retrieve(r.id).output_text == r.output_text
    for call in (lambda: b.responses.retrieve(r.id), lambda: b.responses.delete(r.id),
                 lambda: list(b.responses.retrieve(r.id, stream=True))):
        with pytest.raises(openai.NotFoundError):
            call()
    unstored = a.responses.create(model="stories260k", input="Once", max_output_tokens=4, store=False)
    assert unstored.output_text
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(unstored.id)
    a.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.delete(r.id)
    with pytest.raises(openai.BadRequestError):            # only background responses are cancelled
        a.responses.cancel(a.responses.create(model="stories260k", input="Once", max_output_tokens=4).id)


def test_a_cut_stream_is_cancelled_unless_background(server, slow):
    """Without background the connection is the response's life (on_disconnect's default,
    cancel); a background one runs on (see the resume test)."""
    c = client(server)
    with c.responses.create(model="stories260k", input="Once", max_output_tokens=300, stream=True,
                            extra_body={"ignore_eos": True}) as s:
        rid = next(iter(s)).response.id
    done = wait_for(lambda: (x := c.responses.retrieve(rid)).status not in ("queued", "in_progress") and x)
    assert done.status == "cancelled" and done.usage.output_tokens < 300


def test_stored_responses_are_bounded_by_the_finished_budget(stories_path):
    s = start_server(stories_path, engine_options={"max_finished_kept": 2})
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        first = c.responses.create(model="stories260k", input="Once", max_output_tokens=4, background=True)
        wait_for(lambda: c.responses.retrieve(first.id).status == "incomplete")
        for _ in range(3):
            c.responses.create(model="stories260k", input="Once", max_output_tokens=4)
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(first.id)
    finally:
        stop_server(s)


def test_the_sdk_helpers_parse_and_stream_a_pydantic_format(server):
    """client.responses.parse / .stream(text_format=Model): the SDK builds the strict schema,
    accumulates the stream's events itself and parses the text into the model."""
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=8)
        age: int = Field(ge=0, le=9)
    c = client(server)
    parsed = c.responses.parse(model="stories260k", input="Once", max_output_tokens=60, text_format=Person,
                               temperature=0)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Person)
    with c.responses.stream(model="stories260k", input="Once", max_output_tokens=60, text_format=Person,
                            temperature=0) as s:
        final = s.get_final_response()
    assert final.output_parsed == parsed.output_parsed and final.output_text == parsed.output_text
