"""POST /tokenize and /detokenize in vLLM's shapes: a prompt's ids as the engine encodes them, a
chat's as a chat completion renders them (its usage.prompt_tokens is the count), ids back to
text; bad bodies are 400s naming the field, another model a 404."""
import httpx
import pytest

from .conftest import start_server, stop_server


@pytest.fixture(scope="module")
def server(stories_path):
    s = start_server(stories_path)
    yield s
    stop_server(s)


def test_tokenize_a_prompt(server):
    tok = server.engine.tokenizer
    r = httpx.post(server.url + "/tokenize", json={"model": "stories260k", "prompt": "Once upon a time"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode("Once upon a time") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == server.engine.max_context and body["token_strs"] is None
    bare = httpx.post(server.url + "/tokenize", json={"prompt": "Once upon a time", "add_special_tokens": False,
                                                      "return_token_strs": True}).json()
    assert bare["tokens"] == body["tokens"][1:] and bare["token_strs"] == [tok.id_to_token(i) for i in bare["tokens"]]


def test_tokenize_messages_counts_what_a_chat_completion_prompts(server):
    messages = [{"role": "user", "content": "Lily saw a dog </s> and"}]
    body = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()
    chat = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert body["count"] == chat["usage"]["prompt_tokens"] == len(body["tokens"])
    assert server.engine.tokenizer.eos_token_ids[0] not in body["tokens"]      # "</s>" typed stays text
    no_prompt = httpx.post(server.url + "/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert no_prompt["count"] < body["count"]


def test_detokenize(server):
    ids = server.engine.tokenizer.encode("Once upon a time")
    r = httpx.post(server.url + "/detokenize", json={"model": "stories260k", "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": server.engine.tokenizer.decode(ids, skip_special_tokens=False)}
    assert "Once upon a time" in r.json()["prompt"]


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, 400, None),
    ("/tokenize", {}, 400, None),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"model": "other", "prompt": "a"}, 404, "model"),
    ("/detokenize", {"tokens": [1, "x"]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10 ** 6]}, 400, "tokens"),
    ("/detokenize", {"tokens": [True]}, 400, "tokens"),
])
def test_bad_bodies(server, path, body, status, param):
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
