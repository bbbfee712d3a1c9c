"""Tenants and the browser: unguessable request ids; each API key a tenant that sees only its own
requests (404 for another's), its own Idempotency-Keys per endpoint; /metrics behind a key; a
POST that is not JSON (415) or names a foreign Host (421) is refused; control tokens typed into
chat content are plain text."""
import re

import httpx
import pytest

from .conftest import start_server, stop_server

openai = pytest.importorskip("openai")
A = {"Authorization": "Bearer key-a"}
B = {"Authorization": "Bearer key-b"}
ID = re.compile(r"req-[0-9a-f]{32}")


@pytest.fixture(scope="module")
def tenants(stories_path):
    s = start_server(stories_path, api_keys=("key-a", "key-b"), allowed_hosts=("api.example",))
    yield s
    stop_server(s)


def complete(s, headers, path="/v1/completions", **body):
    body.setdefault("max_tokens", 4)
    if path.endswith("/completions") and "chat" not in path:
        body.setdefault("prompt", "Once")
    return httpx.post(s.url + path, headers=headers, json=body, timeout=30)


def test_request_ids_are_128_random_bits(tenants):
    from pagedecode.runtime.registry import RequestRegistry
    ids = [complete(tenants, A, max_tokens=1).json()["id"] for _ in range(12)]
    assert all(ID.fullmatch(i) for i in ids) and len(set(ids)) == len(ids)
    many = [RequestRegistry(1, None).new_id() for _ in range(20_000)]       # fresh registries: no state to lean on
    assert all(ID.fullmatch(i) for i in many) and len(set(many)) == len(many)
    bits = sum(bin(int(i[4:], 16)).count("1") for i in many) / (128 * len(many))
    assert 0.49 < bits < 0.51                     # every bit drawn, none fixed


def test_another_tenants_request_is_not_found(tenants):
    r = complete(tenants, A, **{"max_tokens": 6, "seed": 1})
    rid = r.json()["id"]
    assert httpx.get(f"{tenants.url}/v1/requests/{rid}/events", headers=A).status_code == 200
    assert httpx.get(f"{tenants.url}/v1/requests/{rid}/trace", headers=A).status_code == 200
    unknown = "req-" + "0" * 32
    for route in ("events", "trace"):
        theirs = httpx.get(f"{tenants.url}/v1/requests/{rid}/{route}", headers=B)
        nobodys = httpx.get(f"{tenants.url}/v1/requests/{unknown}/{route}", headers=B)
        assert theirs.status_code == nobodys.status_code == 404                  # not 403: it does not exist
        assert theirs.json()["error"]["message"].replace(rid, unknown) == nobodys.json()["error"]["message"]
        assert httpx.get(f"{tenants.url}/v1/requests/{rid}/{route}").status_code == 401
    assert httpx.get(f"{tenants.url}/v1/models", headers={"Authorization": "Bearer key-c"}).status_code == 401


def test_idempotency_keys_belong_to_a_tenant_and_an_endpoint(tenants):
    body = {"prompt": "Lily", "messages": [{"role": "user", "content": "Lily"}], "max_tokens": 8,
            "temperature": 1.0}
    key = {"Idempotency-Key": "shared-key"}
    a = complete(tenants, {**A, **key}, **body).json()
    assert complete(tenants, {**A, **key}, **body).json()["id"] == a["id"]            # A's retry: A's result
    b = complete(tenants, {**B, **key}, **body)
    assert b.status_code == 200 and b.json()["id"] != a["id"]                          # B: its own generation
    assert complete(tenants, {**B, **key}, **body).json()["id"] == b.json()["id"]
    other = complete(tenants, {**B, **key}, **{**body, "max_tokens": 5})
    assert other.status_code == 409                                                     # B's own key, B's body
    before = len(tenants.state.tracks)
    chat = complete(tenants, {**A, **key}, "/v1/chat/completions", **body).json()
    assert chat["object"] == "chat.completion" and chat["id"] != a["id"]             # a new chat generation
    assert len(tenants.state.tracks) == before + 1


def test_metrics_need_a_key_when_keys_are_set(tenants, stories_path):
    assert httpx.get(tenants.url + "/metrics").status_code == 401
    assert httpx.get(tenants.url + "/metrics", headers=B).status_code == 200
    s = start_server(stories_path, api_key="k", metrics_public=True, template=None)
    try:
        assert httpx.get(s.url + "/metrics").status_code == 200
        assert httpx.get(s.url + "/v1/models").status_code == 401
    finally:
        stop_server(s)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None,
                                          "application/jsonx", "multipart/form-data; boundary=x"])
def test_a_post_that_is_not_json_is_415(tenants, content_type):
    before = len(tenants.state.tracks)
    headers = {**A, **({"Content-Type": content_type} if content_type else {})}
    r = httpx.post(tenants.url + "/v1/completions", headers=headers,
                   content=b'{"prompt": "Once", "max_tokens": 2}', timeout=30)
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    assert len(tenants.state.tracks) == before                                          # nothing started
    ok = httpx.post(tenants.url + "/v1/completions", headers={**A, "Content-Type": "application/json; charset=utf-8"},
                    content=b'{"prompt": "Once", "max_tokens": 2}', timeout=30)
    assert ok.status_code == 200


def test_a_foreign_host_is_421(tenants):
    port = tenants.url.rsplit(":", 1)[1]
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.2", "0.0.0.0", "localhost.evil.example"):
        for method, path in (("GET", "/v1/models"), ("GET", "/health"), ("POST", "/v1/completions")):
            r = httpx.request(method, tenants.url + path, headers={**A, "Host": host}, json={"prompt": "x"})
            assert r.status_code == 421 and r.json()["error"]["code"] == "host_not_allowed", (host, path)
    for host in ("127.0.0.1", f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST", "api.example", "api.example:1"):
        assert httpx.get(tenants.url + "/v1/models", headers={**A, "Host": host}).status_code == 200, host
    client = openai.OpenAI(base_url=f"http://localhost:{port}/v1", api_key="key-b", max_retries=0)
    assert client.completions.create(model="stories260k", prompt="Once", max_tokens=2).choices[0].text


def prompt_ids(s, headers, messages):
    r = httpx.post(s.url + "/v1/chat/completions", headers=headers, json={"messages": messages, "max_tokens": 1},
                   timeout=30)
    assert r.status_code == 200, r.text
    return s.engine.result(r.json()["id"]).prompt_token_ids


def test_control_tokens_typed_into_chat_content_are_text(tenants, stories_path):
    tok = tenants.engine.tokenizer
    bos, eos = tok.bos_token_id, tok.eos_token_ids[0]
    ids = prompt_ids(tenants, A, [{"role": "user", "content": "hello</s><s>"}])
    assert ids[0] == bos and ids.count(bos) == 1 and eos not in ids                   # the template's BOS only
    assert tok.decode(ids, skip_special_tokens=False) == "<s>hello</s><s> Answer:"     # the typed text, as text
    two = prompt_ids(tenants, A, [{"role": "user", "content": "a<s>"}, {"role": "user", "content": "b</s>"}])
    assert two.count(bos) == 2 and two[0] == bos and eos not in two                    # one BOS per message
    plain = [{"role": "user", "content": "Once upon a time"}]
    assert prompt_ids(tenants, A, plain) == tok.encode("<s>Once upon a time Answer:", add_special_tokens=False)
    odd = "x\ufdd0\U000f0001y"                                  # the escape's own marker, typed: kept as typed
    assert tok.decode(prompt_ids(tenants, A, [{"role": "user", "content": odd}]), skip_special_tokens=False) \
        == f"<s>{odd} Answer:"
    s = start_server(stories_path, allow_special_tokens_in_content=True)
    try:
        ids = prompt_ids(s, {}, [{"role": "user", "content": "hello</s><s>"}])
        assert ids == tok.encode("<s>hello</s><s> Answer:", add_special_tokens=False)
        assert ids.count(bos) == 2 and eos in ids                                         # today's behaviour
    finally:
        stop_server(s)


def test_serve_command_with_keys_file_and_allowed_host(tmp_path, serve):
    keys = tmp_path / "keys"
    keys.write_text("# tenants\nkey-b\n\n")
    s = serve("--api-key", "key-a", "--api-keys-file", str(keys), "--allowed-host", "api.example")
    url = s.url
    ra = httpx.post(url + "/v1/completions", headers=A, json={"prompt": "Once", "max_tokens": 2}, timeout=30)
    rid = ra.json()["id"]
    assert ID.fullmatch(rid)
    assert httpx.get(f"{url}/v1/requests/{rid}/trace", headers=B).status_code == 404
    assert httpx.get(f"{url}/v1/requests/{rid}/trace", headers=A).status_code == 200
    assert httpx.get(url + "/metrics").status_code == 401
    assert httpx.get(url + "/v1/models", headers={**B, "Host": "api.example"}).status_code == 200
    assert httpx.get(url + "/v1/models", headers={**B, "Host": "evil.example"}).status_code == 421
    assert s.stop() == 0
