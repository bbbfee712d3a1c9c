"""Tool calling over HTTP on the built-in random model (it follows nothing but the grammar):
chat completions' tools, tool_choice and parallel_tool_calls, in OpenAI's shapes, streamed and
not, through the official openai client; the history's tool turns rendered; 400s naming the
field. A Hermes-style template (native tools) and the plain test template (the generic format)."""
import json

import httpx
import pytest

from .conftest import TEMPLATE, start_server, stop_server

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t | tojson }}{% endfor %}"
    " Call them as <tool_call>JSON</tool_call>.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": 0, "maximum": 99}},
                                       "required": ["zone"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def start(template, **options):
    from pagedecode.model.default_model import default_model_path
    return start_server(default_model_path(), template=template, engine_options={"model_name": "stories260k"},
                        **options)


@pytest.fixture(scope="module", params=["hermes", "generic"])
def server(request):
    s = start(HERMES_TEMPLATE if request.param == "hermes" else TEMPLATE)
    assert s.state.tool_format.name == request.param
    yield s
    stop_server(s)


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def check_calls(calls, names=None):
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        assert names is None or c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def ask(client, **kw):
    kw = {"max_tokens": 120, "temperature": 0, **kw}
    return client.chat.completions.create(model="stories260k", messages=[{"role": "user", "content": "weather?"}],
                                          **kw)


def test_named_and_required_calls_parse_and_validate(client):
    named = ask(client, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls) == 1
    check_calls(choice.message.tool_calls, {"get_time"})
    required = ask(client, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, seed=3,
                   temperature=1.0)
    assert required.choices[0].finish_reason == "tool_calls"
    assert len(required.choices[0].message.tool_calls) == 1
    check_calls(required.choices[0].message.tool_calls)


@pytest.mark.parametrize("parallel", [False, True])
def test_streamed_deltas_equal_the_body(client, parallel):
    kw = dict(tools=[WEATHER, TIME], tool_choice="required", seed=11, temperature=1.0, parallel_tool_calls=parallel)
    body = ask(client, **kw).choices[0]
    calls, content, reasons, first = {}, "", [], {}
    for chunk in ask(client, stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                if tc.index not in calls:            # its first delta: id and name
                    assert tc.id and tc.function.name
                    first[tc.index] = tc
                    calls[tc.index] = {"name": tc.function.name, "arguments": ""}
                else:
                    assert tc.id is None
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            if ch.finish_reason:
                reasons.append(ch.finish_reason)
    assert reasons == [body.finish_reason]
    assert body.finish_reason == "tool_calls" if not parallel else body.finish_reason in ("tool_calls", "length")
    assert [calls[i] for i in sorted(calls)] == [
        {"name": c.function.name, "arguments": c.function.arguments} for c in body.message.tool_calls]
    assert content == (body.message.content or "")


NOTE = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"], "additionalProperties": False}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "note"}}])
def test_a_call_closed_at_its_budget_streams_as_its_body(client, choice):
    """The random model never ends a free string: the call is closed within max_tokens (its text
    truncated), a valid call, and the streamed deltas are the body's."""
    kw = dict(tools=[NOTE], tool_choice=choice, seed=7, temperature=1.0, max_tokens=60)
    body = ask(client, **kw)
    ch = body.choices[0]
    assert ch.finish_reason == "tool_calls" and body.usage.completion_tokens <= 60
    [call] = ch.message.tool_calls
    assert isinstance(json.loads(call.function.arguments)["text"], str)
    calls, reasons = {}, []
    for chunk in ask(client, stream=True, **kw):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                calls.setdefault(tc.index, "")
                calls[tc.index] += tc.function.arguments or ""
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert reasons == ["tool_calls"] and calls == {0: call.function.arguments}


def test_a_resumed_tool_stream_sends_what_followed(server):
    """Last-Event-ID resumes a tool-calling stream: the parser is fed what the client had, so
    the rest is byte-identical to the first stream's rest (the same call ids)."""
    body = {"messages": [{"role": "user", "content": "w"}], "max_tokens": 120, "tools": [WEATHER, TIME],
            "tool_choice": "required", "parallel_tool_calls": False, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        rid = r.headers["x-request-id"]
        frames = [f for f in r.read().decode().split("\n\n") if f]
    ids = [int(f.split("\n")[0][4:]) for f in frames if f.startswith("id: ")]
    cut = ids[len(ids) // 2]
    rest = httpx.get(f"{server.url}/v1/requests/{rid}/events", headers={"Last-Event-ID": str(cut)}, timeout=60)
    assert [f for f in rest.text.split("\n\n") if f] == frames[frames.index(next(
        f for f in frames if f.startswith(f"id: {cut}\n"))) + 1:]


def test_cut_call_is_length(client):
    short = client.chat.completions.create(model="stories260k", messages=[{"role": "user", "content": "w"}],
                                           tools=[WEATHER], tool_choice="required", max_tokens=3)
    assert short.choices[0].finish_reason == "length"


def test_tool_choice_none_and_auto_without_calls(client):
    none = ask(client, tools=[WEATHER], tool_choice="none", max_tokens=8)
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].finish_reason in ("stop", "length")
    auto = ask(client, tools=[WEATHER], max_tokens=60, seed=5, temperature=1.0)
    ch = auto.choices[0]
    assert (ch.finish_reason == "tool_calls") == bool(ch.message.tool_calls)


def test_two_turn_tool_loop(client, server):
    """The official client's loop: call, run the tool, send its result back, answer."""
    messages = [{"role": "user", "content": "weather in Paris?"}]
    first = ask(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False).choices[0].message
    check_calls(first.tool_calls)
    messages.append(first.model_dump(exclude_none=True))
    for c in first.tool_calls:
        messages.append({"role": "tool", "tool_call_id": c.id, "content": "sunny, 21C"})
    second = client.chat.completions.create(model="stories260k", messages=messages, tools=[WEATHER],
                                            tool_choice="none", max_tokens=8)
    assert second.choices[0].message.content is not None
    assert second.choices[0].finish_reason in ("stop", "length")
    streamed = list(client.chat.completions.create(model="stories260k", messages=messages, tools=[WEATHER],
                                                   max_tokens=30, stream=True))
    assert streamed[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_history_is_rendered_by_the_template(server):
    from pagedecode.server.admission import prompts_of
    from pagedecode.server.protocol import parse_request
    fmt = server.state.tool_format
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "snowing"}]
    parsed = parse_request({"messages": messages, "tools": [WEATHER]}, True, {}, server.state.options.limits,
                           tool_format=fmt)
    [ids] = prompts_of(server.state, parsed)
    text = server.engine.tokenizer.decode(ids)
    if fmt.name == "hermes":       # the template's own tool rendering
        assert '"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}' in text
        assert "snowing" in text and "Tools:" in text
    else:                          # the plain template renders user turns only: the generic envelope goes
        assert "snowing" in text and "You can call these tools" not in text   # there as a user turn


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"functions": [WEATHER["function"]]}, "functions"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(unclosed"}}}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
])
def test_bad_tools_are_400_naming_the_field(server, body, param):
    full = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
    r = httpx.post(server.url + "/v1/chat/completions", json=full, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


# -- the Responses API's function tools ---------------------------------------------------------------
FLAT = [{"type": "function", **t["function"]} for t in (WEATHER, TIME)]


def test_responses_function_call_items(client):
    r = client.responses.create(model="stories260k", input="time?", tools=FLAT, max_output_tokens=120,
                                tool_choice={"type": "function", "name": "get_time"}, temperature=0)
    [call] = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and call.name == "get_time" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_time"])
    again = client.responses.retrieve(r.id)
    assert [o.model_dump() for o in again.output] == [o.model_dump() for o in r.output]


def test_responses_stream_function_call_arguments(client):
    events = list(client.responses.create(model="stories260k", input="w", tools=FLAT, tool_choice="required",
                                          parallel_tool_calls=False, max_output_tokens=120, stream=True,
                                          temperature=1.0, extra_body={"seed": 4}))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    [call] = [o for o in events[-1].response.output if o.type == "function_call"]
    assert deltas == done.arguments == call.arguments
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_tool_loop(client):
    first = client.responses.create(model="stories260k", input="weather?", tools=FLAT, tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=120, temperature=0)
    [call] = [o for o in first.output if o.type == "function_call"]
    second = client.responses.create(
        model="stories260k", tools=FLAT, tool_choice="none", max_output_tokens=6,
        input=[{"role": "user", "content": "weather?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert [o.type for o in second.output] == ["message"]


def test_responses_bad_tool_names_the_flat_field(server):
    body = {"model": "stories260k", "input": "x", "tools": [{"type": "function", "name": "f",
                                                              "parameters": {"type": "array"}}]}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].parameters", r.text


def test_langchain_bind_tools_agent_loop(server):
    """langchain-openai's bind_tools loop, unchanged: call, ToolMessage back, answer."""
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    llm = lc.ChatOpenAI(model="stories260k", base_url=server.url + "/v1", api_key="none", max_tokens=120,
                        temperature=0, max_retries=0)
    bound = llm.bind_tools([WEATHER], tool_choice="get_weather", parallel_tool_calls=False)
    messages = [HumanMessage("weather in Paris?")]
    ai = bound.invoke(messages)
    [call] = ai.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], SCHEMAS["get_weather"])
    messages += [ai, ToolMessage("sunny", tool_call_id=call["id"])]
    answer = llm.bind_tools([WEATHER], tool_choice="none").invoke(messages, max_tokens=6)
    assert isinstance(answer.content, str) and not answer.tool_calls
