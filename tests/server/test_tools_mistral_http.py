"""Mistral's [TOOL_CALLS] format over HTTP on the built-in random model: the calls a server returns
are named with 9 letters and digits (Mistral's templates refuse other ids when the client sends
the call back), on the chat completions body, its stream and the Anthropic Messages API, and the
official openai client's two-turn loop renders. The template is the test's own Mistral-style one
(tests/tools/test_prompt.py), which raises on any other id, as Mistral's do."""
import re

import pytest

from ..tools.test_prompt import MISTRAL_TEMPLATE
from .conftest import start_server, stop_server
from .test_tools_http import WEATHER

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

NINE = re.compile(r"[A-Za-z0-9]{9}")


@pytest.fixture(scope="module")
def server():
    from pagedecode.model.default_model import default_model_path
    s = start_server(default_model_path(), template=MISTRAL_TEMPLATE, engine_options={"model_name": "stories260k"})
    assert s.state.tool_format.name == "mistral"
    yield s
    stop_server(s)


def test_returned_ids_are_nine_letters_and_digits_and_come_back(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "weather in Paris?"}]
    kw = dict(model="stories260k", tools=[WEATHER], tool_choice="required", max_tokens=120, temperature=0)
    first = client.chat.completions.create(messages=messages, **kw).choices[0]
    assert first.finish_reason == "tool_calls"
    ids = [c.id for c in first.message.tool_calls]
    assert ids and all(NINE.fullmatch(i) for i in ids), ids
    streamed = [tc.id for chunk in client.chat.completions.create(messages=messages, stream=True, **kw)
                for ch in chunk.choices for tc in ch.delta.tool_calls or [] if tc.id is not None]
    assert all(NINE.fullmatch(i) for i in streamed) and len(streamed) == len(ids)
    # the client's loop: the call and its result go back; the template takes their ids
    messages.append(first.message.model_dump(exclude_none=True))
    messages += [{"role": "tool", "tool_call_id": i, "content": "sunny"} for i in ids]
    second = client.chat.completions.create(model="stories260k", messages=messages, tools=[WEATHER],
                                            tool_choice="none", max_tokens=4)
    assert second.choices[0].finish_reason in ("stop", "length")
    # a history from another server ("call_..." ids) renders too: mapped, not refused
    foreign = [messages[0], {**messages[1], "tool_calls": [{**c, "id": f"call_{k}x"} for k, c in
                                                           enumerate(messages[1]["tool_calls"])]},
               *({**m, "tool_call_id": f"call_{k}x"} for k, m in enumerate(messages[2:]))]
    third = client.chat.completions.create(model="stories260k", messages=foreign, tools=[WEATHER],
                                           tool_choice="none", max_tokens=4)
    assert third.choices[0].finish_reason in ("stop", "length")


def test_anthropic_tool_use_ids_too(server):
    import httpx
    r = httpx.post(server.url + "/v1/messages", timeout=60, json={
        "model": "stories260k", "max_tokens": 120, "tool_choice": {"type": "any"},
        "tools": [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
        "messages": [{"role": "user", "content": "weather?"}]})
    r.raise_for_status()
    uses = [b for b in r.json()["content"] if b["type"] == "tool_use"]
    assert uses and all(NINE.fullmatch(b["id"]) for b in uses), uses
