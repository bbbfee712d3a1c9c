"""Integers a client writes as text are plain ASCII decimal (issue 34, item 10): Python's int()
forms ("1_0", "+3", " 3", Arabic-Indic digits) are refused where ids, cursors and logit_bias
keys are read; a bodiless POST (cancel) needs no Content-Type; the Responses API's
max_output_tokens error does not mention /v1/completions' echo."""
import httpx
import pytest

from pagedecode.server.integers import parse_decimal

from .conftest import start_server, stop_server

PYTHON_ONLY = ["1_0", "+3", " 3", "3 ", "\u0663", "\uff13", "0x3", "", "-", "3.0", "1" * 20]


@pytest.mark.parametrize("text,value", [("0", 0), ("3", 3), ("-1", -1), ("007", 7), ("9" * 19, int("9" * 19))])
def test_parse_decimal_reads_ascii_decimal(text, value):
    assert parse_decimal(text) == value


@pytest.mark.parametrize("text", PYTHON_ONLY)
def test_parse_decimal_refuses_what_only_python_reads(text):
    assert parse_decimal(text) is None


@pytest.fixture(scope="module")
def server(stories_path):
    s = start_server(stories_path)
    yield s
    stop_server(s)


@pytest.mark.parametrize("key", PYTHON_ONLY)
def test_logit_bias_keys_are_ascii_decimal(server, key):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Once", "max_tokens": 1,
                                                         "logit_bias": {key: 1}}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "Once", "max_tokens": 1,
                                                          "logit_bias": {"3": 1}}, timeout=30)
    assert ok.status_code == 200


def test_cancel_without_a_content_type_is_accepted(server):
    r = httpx.post(server.url + "/v1/responses", json={"model": "stories260k", "input": "Once",
                                                       "max_output_tokens": 200, "background": True}, timeout=30)
    rid = r.json()["id"]
    cancelled = httpx.post(f"{server.url}/v1/responses/{rid}/cancel", timeout=30)
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["id"] == rid
    # a body still needs its media type
    assert httpx.post(f"{server.url}/v1/responses/{rid}/cancel", content=b"{}", timeout=30).status_code == 415


def test_max_output_tokens_error_does_not_mention_echo(server):
    r = httpx.post(server.url + "/v1/responses", json={"model": "stories260k", "input": "Once",
                                                       "max_output_tokens": 0}, timeout=30)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "max_output_tokens"
    assert "echo" not in error["message"], error["message"]
    c = httpx.post(server.url + "/v1/completions", json={"prompt": "Once", "max_tokens": 0}, timeout=30)
    assert "echo" in c.json()["error"]["message"]          # where echo exists, it still says so


@pytest.mark.parametrize("value", ["0_0", "+0", " 0", "\u0660"])       # each is 0 to int()
def test_last_event_id_and_after_are_ascii_decimal(server, value):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Once", "max_tokens": 2}, timeout=30)
    rid = r.headers["X-Request-Id"]
    by_query = httpx.get(f"{server.url}/v1/requests/{rid}/events", params={"after": value}, timeout=30)
    assert by_query.status_code == 400 and by_query.json()["error"]["param"] == "after"
    if value.isascii() and value.strip() == value:      # HTTP trims a header's spaces; headers are ASCII
        by_header = httpx.get(f"{server.url}/v1/requests/{rid}/events", headers={"Last-Event-ID": value}, timeout=30)
        assert by_header.status_code == 400 and by_header.json()["error"]["param"] == "Last-Event-ID"


@pytest.mark.parametrize("value", ["0_0", "+0", " 0", "\u0660"])       # each is 0 to int()
def test_starting_after_is_ascii_decimal(server, value):
    r = httpx.post(server.url + "/v1/responses", json={"model": "stories260k", "input": "Once",
                                                       "max_output_tokens": 2, "background": True}, timeout=30)
    rid = r.json()["id"]
    got = httpx.get(f"{server.url}/v1/responses/{rid}", params={"stream": "true", "starting_after": value}, timeout=30)
    assert got.status_code == 400 and got.json()["error"]["param"] == "starting_after"
