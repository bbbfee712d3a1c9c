"""The server driven by the official openai client and by httpx."""
import json

import httpx
import pytest

openai = pytest.importorskip("openai")

AUTH = {"Authorization": "Bearer sekret"}
REF = ", there was a little girl named Lily. She loved to play"     # stories260k greedy, 16 tokens


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="sekret", max_retries=0)


def test_completion_matches_the_engine(client, server):
    r = client.completions.create(model="stories260k", prompt="Once upon a time", max_tokens=16)
    assert r.choices[0].text == REF and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 16 and r.usage.total_tokens == 21
    assert r.id.startswith("req-") and r.model == "stories260k"


def test_streaming_completion_with_usage(client):
    chunks = list(client.completions.create(model="stories260k", prompt="Once upon a time", max_tokens=16,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == REF
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16 and not chunks[-1].choices


def test_sse_ids_are_the_event_sequence_numbers(server):
    with httpx.stream("POST", server.url + "/v1/completions", headers={"Authorization": "Bearer sekret"},
                      json={"prompt": "Once upon a time", "max_tokens": 5, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["x-request-id"].startswith("req-")
        lines = [ln for ln in r.iter_lines() if ln]
    ids = [int(ln[4:]) for ln in lines if ln.startswith("id: ")]
    assert ids == sorted(set(ids)) and ids[0] >= 1
    assert lines[-1] == "data: [DONE]"


def test_stop_strings_and_finish_reason_mapping(client):
    r = client.completions.create(model="stories260k", prompt="Once upon a time", max_tokens=32, stop=["Lily"])
    c = r.choices[0]
    assert c.text == ", there was a little girl named " and c.finish_reason == "stop"
    assert c.model_extra["stop_reason"] == "Lily" and c.model_extra["pagedecode_finish_reason"] == "stop_sequence"


def test_same_seed_same_text(client):
    kw = dict(model="stories260k", prompt="Lily", max_tokens=20, temperature=1.0, seed=7)
    a, b = (client.completions.create(**kw).choices[0].text for _ in range(2))
    assert a == b
    others = {client.completions.create(**{**kw, "seed": s}).choices[0].text for s in (8, 9, 10)}
    assert len(others | {a}) > 1                     # the seed is what makes them equal


def test_chat_completion_streamed_and_not(client, server):
    msgs = [{"role": "user", "content": "Once upon a time"}]
    r = client.chat.completions.create(model="stories260k", messages=msgs, max_tokens=12)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    ids = server.engine.tokenizer.encode("<s>Once upon a time Answer:", add_special_tokens=False)
    assert r.usage.prompt_tokens == len(ids) and ids.count(1) == 1          # no second BOS
    chunks = list(client.chat.completions.create(model="stories260k", messages=msgs, max_tokens=12, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content


def test_logprobs(client):
    r = client.completions.create(model="stories260k", prompt="Once upon a time", max_tokens=4, logprobs=0)
    lps = r.choices[0].logprobs.token_logprobs
    assert len(lps) == 4 and all(lp <= 0 for lp in lps)


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["stories260k"]
    assert httpx.get(server.url + "/health").status_code == 200


def post(server, body, key="sekret", **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if "content" in kw:
        headers["Content-Type"] = "application/json"
    return httpx.post(server.url + "/v1/completions", headers=headers, timeout=30, **kw,
                      **({"json": body} if body is not None else {}))


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"), ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 2}, "top_p"), ({"prompt": ""}, "prompt"), ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"), ({"prompt": [10**7]}, "prompt"),
    ({"prompt": "x", "n": 0}, "n"), ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stop_token_ids": 5}, "stop_token_ids"),
])
def test_invalid_fields_are_400_naming_the_field(server, body, param):
    r = post(server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


def test_errors_auth_model_body_json(server):
    assert post(server, {"prompt": "x"}, key="wrong").status_code == 401
    assert post(server, {"prompt": "x"}, key=None).status_code == 401
    r = post(server, {"prompt": "x", "model": "gpt-9"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert post(server, None, content=b"{not json").status_code == 400
    assert post(server, None, content=b"x" * (2 << 20)).status_code == 413
    assert post(server, None, content=b"[1, 2]").status_code == 400
    assert server.engine.has_unfinished() is False


def test_chat_without_a_template_is_400(stories_path):
    from .conftest import start_server, stop_server
    s = start_server(stories_path, template=None)
    try:
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
    finally:
        stop_server(s)


def test_metrics_agree_with_what_clients_saw(client, server):
    def scrape():
        text = httpx.get(server.url + "/metrics", headers=AUTH).text
        out = {}
        for line in text.splitlines():
            if line.startswith("pagedecode:") and " " in line:
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out
    before = scrape()
    r = client.completions.create(model="stories260k", prompt="Once upon a time", max_tokens=7)
    after = scrape()
    assert after["pagedecode:generation_tokens_total"] - before.get("pagedecode:generation_tokens_total", 0) == \
        r.usage.completion_tokens
    key = 'pagedecode:request_success_total{finished_reason="max_output_tokens"}'
    assert after[key] - before.get(key, 0) == 1
    # a request that ends otherwise is a failure, by its reason, and no success
    r = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=60,
                   json={"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "timeout": 0.02})
    assert r.json()["choices"][0]["finish_reason"] == "deadline_exceeded"
    later = scrape()
    key = 'pagedecode:request_failure_total{reason="deadline_exceeded"}'
    assert later[key] - after.get(key, 0) == 1
    assert not any(k.startswith("pagedecode:request_success_total") and "deadline" in k for k in later)
    assert sum(v for k, v in later.items() if k.startswith("pagedecode:request_success_total")) == \
        sum(v for k, v in after.items() if k.startswith("pagedecode:request_success_total"))
    assert "pagedecode:time_to_first_token_seconds_bucket" in httpx.get(server.url + "/metrics", headers=AUTH).text


def test_n_choices_are_independent_seeded_requests(client):
    r = client.completions.create(model="stories260k", prompt="Lily", max_tokens=8, n=3, temperature=1.0, seed=3)
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 24


def test_non_streaming_client_that_leaves_cancels_its_request(server):
    import time

    from .conftest import slow_steps
    with slow_steps(server.engine):                  # the request still runs when the client leaves
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", headers={"Authorization": "Bearer sekret"},
                       json={"prompt": "Once", "max_tokens": 400, "ignore_eos": True, "temperature": 1.0,
                             "seed": 1}, timeout=0.3)
        for _ in range(200):
            if not server.engine.has_unfinished():
                break
            time.sleep(0.05)
    assert not server.engine.has_unfinished()
    rid = next(reversed(server.engine.requests._finished))          # the last to finish
    out = server.engine.result(rid)
    assert out.state.value == "cancelled" and out.finish_reason.value == "transport_error"
    assert server.engine.pool.free_pages == server.engine.pool.num_pages


def test_prefix_cache_hits_show_in_usage_and_metrics(client, server):
    system = "Once upon a time, there was a little girl named Lily. She loved to play outside. " * 2
    client.completions.create(model="stories260k", prompt=system + "One day", max_tokens=2)
    r = client.completions.create(model="stories260k", prompt=system + "The end", max_tokens=2)
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % server.engine.config.page_size == 0
    text = httpx.get(server.url + "/metrics", headers=AUTH).text
    hits = [ln for ln in text.splitlines() if ln.startswith("pagedecode:prefix_cache_hits_total")]
    assert hits and float(hits[0].split()[-1]) >= cached


def test_response_format_json_schema(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["name", "age"]}
    r = client.chat.completions.create(
        model="stories260k", messages=[{"role": "user", "content": "Once"}], max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    data = json.loads(r.choices[0].message.content)
    assert set(data) == {"name", "age"} and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["pagedecode_finish_reason"] == "grammar_complete"
    c = client.completions.create(model="stories260k", prompt="Lily", max_tokens=10,
                                  extra_body={"structured_outputs": {"choice": ["red", "blue"]}})
    assert c.choices[0].text in ("red", "blue")


def test_bad_response_format_is_400(server):
    r = post(server, {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "array", "uniqueItems": True}}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert "uniqueItems" in r.json()["error"]["message"]


@pytest.mark.parametrize("field, value", [("best_of", 3), ("suffix", "x")])
def test_unsupported_options_are_refused_not_ignored(server, field, value):
    r = post(server, {"prompt": "x", field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field


def test_streamed_logprobs_come_with_their_chunks(client):
    chunks = list(client.chat.completions.create(model="stories260k", messages=[{"role": "user", "content": "Once"}],
                                                 max_tokens=6, stream=True, logprobs=True, top_logprobs=2))
    content = [lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    assert len(content) == 6 and all(len(lp.top_logprobs) == 2 for lp in content)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "".join(lp.token for lp in content) == text
