"""An answer the client began, continued: chat completions' continue_final_message (vLLM's field,
with add_generation_prompt: false) and the Anthropic Messages API's prefill (a final assistant
message), on the real model (SmolLM2-135M-Instruct) through the official openai and anthropic
clients on a real server. The output continues the begun answer exactly as a completion of the
rendered text, cut after it, does; that text holds none of the begun answer."""
import pytest

from pagedecode.server.chat import ChatTemplate, continued, load_template
from pagedecode.server.errors import ApiError

from .conftest import start_server, stop_server

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")

QUESTION = "Write a Python function that adds two numbers."
BEGUN = "```python\ndef add("
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


@pytest.fixture(scope="module")
def server(smollm2_path):
    source, _ = load_template(smollm2_path)
    s = start_server(smollm2_path, template=source, engine_options={"max_batch_size": 4})
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def rendered(server):
    """The prompt as text: the chat's template with the begun answer, cut after it."""
    template = server.state.chat_template
    text = template.render([{"role": "user", "content": QUESTION}])
    return text + BEGUN


def chat(server, messages, **extra):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    return client.chat.completions.create(model="stories260k", messages=messages, max_tokens=24, temperature=0,
                                          extra_body=extra)


def begun():
    return [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": BEGUN}]


def test_chat_continues_the_final_message_as_a_completion_of_its_text(server, rendered):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    plain = client.completions.create(model="stories260k", prompt=rendered, max_tokens=24, temperature=0)
    r = chat(server, begun(), **CONTINUE)
    assert r.choices[0].message.content == plain.choices[0].text
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens
    assert not r.choices[0].message.content.startswith(BEGUN)
    # not continued, the begun answer is a finished turn and a new one opens: another prompt
    closed = chat(server, begun())
    assert closed.usage.prompt_tokens > r.usage.prompt_tokens
    # streamed, the same text
    stream = client.chat.completions.create(model="stories260k", messages=begun(), max_tokens=24, temperature=0,
                                            stream=True, extra_body=CONTINUE)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == plain.choices[0].text


def test_tokenize_counts_the_continued_prompt(server):
    r = chat(server, begun(), **CONTINUE)
    body = {"model": "stories260k", "messages": begun(), **CONTINUE}
    counted = httpx.post(server.url + "/tokenize", json=body).json()
    assert counted["count"] == r.usage.prompt_tokens
    both = httpx.post(server.url + "/tokenize", json={**body, "add_generation_prompt": True})
    assert both.status_code == 400 and "continue_final_message" in both.text


@pytest.mark.parametrize("body", [
    {"continue_final_message": True},                                   # add_generation_prompt defaults true
    {"continue_final_message": True, "add_generation_prompt": True},
    {"continue_final_message": "yes", "add_generation_prompt": False},
    {"add_generation_prompt": 1},
])
def test_bad_fields_are_a_400_naming_them(server, body):
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, begun(), **body)
    assert e.value.body["param"] in ("continue_final_message", "add_generation_prompt")
    assert server.state.engine.snapshot().running == 0


def test_empty_final_message_cannot_be_continued(server):
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": ""}], **CONTINUE)
    assert e.value.body["param"] == "messages"
    chat(server, begun(), **CONTINUE)           # and the server goes on


def test_anthropic_prefill_continues_the_final_assistant_message(server):
    expected = chat(server, begun(), **CONTINUE).choices[0].message.content
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    m = client.messages.create(model="stories260k", max_tokens=24, messages=begun(), extra_body={"temperature": 0.0})
    assert m.content[0].text == expected
    with client.messages.stream(model="stories260k", max_tokens=24, messages=begun(),
                                extra_body={"temperature": 0.0}) as s:
        assert s.get_final_text() == expected
    # an empty final assistant message is no prefill: the answer of the question alone
    alone = client.messages.create(model="stories260k", max_tokens=24, extra_body={"temperature": 0.0},
                                   messages=[{"role": "user", "content": QUESTION}])
    empty = client.messages.create(model="stories260k", max_tokens=24, extra_body={"temperature": 0.0},
                                   messages=[{"role": "user", "content": QUESTION},
                                             {"role": "assistant", "content": ""}])
    assert empty.content[0].text == alone.content[0].text
    assert empty.usage.input_tokens == alone.usage.input_tokens


def test_anthropic_prefill_with_trailing_whitespace_is_refused(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="stories260k", max_tokens=8, messages=[
            {"role": "user", "content": QUESTION}, {"role": "assistant", "content": [{"type": "text", "text": "Sure "}]}])
    assert "trailing whitespace" in str(e.value) and "messages[1].content" in str(e.value)


TRIMMING = ("{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_continued_keeps_what_the_template_kept():
    t = ChatTemplate(TRIMMING, {})
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  Hello there  "}]
    assert t.render(msgs, add_generation_prompt=False, continue_final_message=True) == \
        "<user>hi</user><assistant>Hello there"
    keeps = ChatTemplate(TRIMMING.replace(" | trim", ""), {})
    assert keeps.render(msgs, add_generation_prompt=False, continue_final_message=True) == \
        "<user>hi</user><assistant>  Hello there  "
    # the cut is at the last occurrence: a final message that repeats an earlier one's text
    same = [{"role": "user", "content": "echo"}, {"role": "assistant", "content": "echo"}]
    assert keeps.render(same, add_generation_prompt=False, continue_final_message=True) == \
        "<user>echo</user><assistant>echo"


def test_a_template_that_drops_the_final_message_cannot_continue_it():
    t = ChatTemplate("{% for m in messages if m.role == 'user' %}{{ m.content }}{% endfor %}", {})
    with pytest.raises(ApiError) as e:
        t.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}],
                 add_generation_prompt=False, continue_final_message=True)
    assert e.value.status == 400 and e.value.param == "messages"
    with pytest.raises(ApiError):
        continued("<x>", {"role": "assistant", "content": None})
