"""The request contract over HTTP: resume, idempotent retries, timeouts, admission, disconnects,
trace, graceful shutdown."""
import json
import signal
import subprocess
import sys
import time

import httpx

from .conftest import start_server, stop_server

AUTH = {"Authorization": "Bearer sekret"}


def sse(lines):
    """[(id or None, data dict or "[DONE]")] from SSE lines."""
    out, cur = [], None
    for ln in lines:
        if ln.startswith("id: "):
            cur = int(ln[4:])
        elif ln.startswith("data: "):
            data = ln[6:]
            out.append((cur, data if data == "[DONE]" else json.loads(data)))
            cur = None
    return out


def texts(items):
    return "".join(d["choices"][0].get("text", "") for _, d in items
                   if isinstance(d, dict) and d.get("choices"))


def wait_idle(engine, timeout=20):
    end = time.time() + timeout
    while engine.has_unfinished() and time.time() < end:
        time.sleep(0.02)
    assert not engine.has_unfinished()


def test_resume_with_last_event_id_gets_every_byte_once(server):
    body = {"prompt": "Once upon a time", "max_tokens": 40, "stream": True, "on_disconnect": "continue"}
    got = []
    with httpx.stream("POST", server.url + "/v1/completions", headers=AUTH, json=body) as r:
        rid = r.headers["x-request-id"]
        for ln in r.iter_lines():
            if ln:
                got.append(ln)
            if sum(1 for x in got if x.startswith("id: ")) == 5:
                break                                           # the connection drops here
    first = sse(got)
    last_id = max(i for i, _ in first if i is not None)
    with httpx.stream("GET", f"{server.url}/v1/requests/{rid}/events", headers={**AUTH, "Last-Event-ID": str(last_id)}) as r:
        assert r.status_code == 200
        rest = sse([ln for ln in r.iter_lines() if ln])
    ids = [i for i, _ in first + rest if i is not None]
    assert len(ids) == len(set(ids)) and ids == sorted(ids)     # nothing twice, in order
    full = server.engine.result(rid).text
    assert texts(first) + texts(rest) == full and rest[-1][1] == "[DONE]"
    with httpx.stream("GET", f"{server.url}/v1/requests/{rid}/events?after=-1", headers=AUTH) as r:
        again = sse([ln for ln in r.iter_lines() if ln])        # a finished request replays whole
    assert texts(again) == full
    assert httpx.get(f"{server.url}/v1/requests/nope/events", headers=AUTH).status_code == 404


def test_idempotent_retry_is_one_generation(server):
    before = len(server.state.tracks)
    body = {"prompt": "Lily", "max_tokens": 12, "temperature": 1.0}   # no seed: a second run would differ
    h = {**AUTH, "Idempotency-Key": "k-1"}
    a = httpx.post(server.url + "/v1/completions", headers=h, json=body, timeout=30).json()
    b = httpx.post(server.url + "/v1/completions", headers=h, json=body, timeout=30).json()
    assert a["id"] == b["id"] and a["choices"][0]["text"] == b["choices"][0]["text"]
    assert len(server.state.tracks) == before + 1                    # one generation
    metrics = httpx.get(server.url + "/metrics", headers=AUTH).text
    assert "pagedecode:idempotent_replays_total 1.0" in metrics
    r = httpx.post(server.url + "/v1/completions", headers=h, json={**body, "max_tokens": 13})
    assert r.status_code == 409 and r.json()["error"]["code"] == "idempotency_key_reused"


def test_streamed_retry_attaches_to_the_live_request(server):
    body = {"prompt": "Once upon a time", "max_tokens": 60, "stream": True, "on_disconnect": "continue"}
    h = {**AUTH, "Idempotency-Key": "k-stream"}
    with httpx.stream("POST", server.url + "/v1/completions", headers=h, json=body) as r:
        rid = r.headers["x-request-id"]
        for ln in r.iter_lines():
            if ln.startswith("id: 3"):
                break
    with httpx.stream("POST", server.url + "/v1/completions", headers=h, json=body) as r:
        assert r.headers["x-request-id"] == rid
        items = sse([ln for ln in r.iter_lines() if ln])
    assert texts(items) == server.engine.result(rid).text              # from the start, once


def test_first_token_timeout_and_total_timeout(stories_path):
    s = start_server(stories_path, template=None)
    try:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "Once", "max_tokens": 5,
                                                         "first_token_timeout": 1e-6}, timeout=30)
        body = r.json()
        c = body["choices"][0]
        assert c["finish_reason"] == "deadline_exceeded" and "first token" in body["pagedecode_error"]
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "Once", "max_tokens": 2000, "ignore_eos": True,
                                                         "timeout": 0.05}, timeout=30)
        c = r.json()["choices"][0]
        assert c["finish_reason"] == "deadline_exceeded" and c["pagedecode_finish_reason"] == "deadline_exceeded"
        u = r.json()["usage"]                                  # metered like any other ending
        assert u["completion_tokens"] == s.engine.result(r.json()["id"]).usage.returned_tokens
    finally:
        stop_server(s)


def test_queue_full_is_429_with_retry_after(stories_path):
    s = start_server(stories_path, template=None, max_queued_requests=0)
    try:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
    finally:
        stop_server(s)


def test_streaming_disconnect_cancels_with_transport_error(server):
    body = {"prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True, "temperature": 1.0, "seed": 2}
    with httpx.stream("POST", server.url + "/v1/completions", headers=AUTH, json=body) as r:
        rid = r.headers["x-request-id"]
        for ln in r.iter_lines():
            if ln.startswith("id: 2"):
                break
    wait_idle(server.engine)
    out = server.engine.result(rid)
    assert out.state.value == "cancelled" and out.finish_reason.value == "transport_error"
    assert server.engine.pool.free_pages == server.engine.pool.num_pages
    end = time.time() + 5                # metered by the watcher on the server's loop, just after the end
    while not server.state.tracks[rid].metered and time.time() < end:
        time.sleep(0.01)
    assert server.state.tracks[rid].metered


def test_resume_within_grace_keeps_the_request(stories_path):
    s = start_server(stories_path, template=None, resume_grace_s=5.0)
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 30, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body) as r:
            rid = r.headers["x-request-id"]
            for ln in r.iter_lines():
                if ln.startswith("id: 2"):
                    break
        with httpx.stream("GET", f"{s.url}/v1/requests/{rid}/events", headers={"Last-Event-ID": "2"}) as r:
            rest = sse([ln for ln in r.iter_lines() if ln])
        out = s.engine.result(rid)
        assert out.state.value == "finished" and rest[-1][1] == "[DONE]"
        assert s.state.tracks[rid].resumes == 1
    finally:
        stop_server(s)


def test_trace_endpoint_is_chrome_json_on_the_wall_clock(server):
    r = httpx.post(server.url + "/v1/completions", headers=AUTH, json={"prompt": "Once", "max_tokens": 3})
    rid = r.headers["x-request-id"]
    t = httpx.get(f"{server.url}/v1/requests/{rid}/trace", headers=AUTH).json()
    evs = [e for e in t["traceEvents"] if e["ph"] != "M"]
    assert evs and all({"name", "ph", "ts", "pid", "tid"} <= set(e) for e in evs)
    assert all(abs(e["ts"] / 1e6 - time.time()) < 600 for e in evs)       # wall-clock microseconds
    assert httpx.get(f"{server.url}/v1/requests/nope/trace", headers=AUTH).status_code == 404


def test_a_keyerror_bug_in_the_engine_path_is_a_500_not_a_request_gone(server, monkeypatch):
    """Only the engine's UnknownRequestError (ForgottenRequestError among them) means "no such
    request" (404): a plain KeyError raised on the way is a bug, answered 500."""
    import pagedecode as pd
    r = httpx.post(server.url + "/v1/completions", headers=AUTH, json={"prompt": "Once", "max_tokens": 2})
    rid = r.headers["x-request-id"]

    def raising(error):
        def call(*args, **kwargs):
            raise error
        return call
    monkeypatch.setattr(server.engine, "trace", raising(KeyError("a bug, not a missing request")))
    t = httpx.get(f"{server.url}/v1/requests/{rid}/trace", headers=AUTH)
    assert t.status_code == 500 and t.json()["error"]["code"] == "internal_error", t.text
    monkeypatch.setattr(server.engine, "pin", raising(KeyError("a bug, not a missing request")))
    e = httpx.get(f"{server.url}/v1/requests/{rid}/events", headers=AUTH)
    assert e.status_code == 500 and e.json()["error"]["code"] == "internal_error", e.text
    gone = pd.ForgottenRequestError(f"request {rid!r} finished and was forgotten")
    monkeypatch.setattr(server.engine, "trace", raising(gone))
    monkeypatch.setattr(server.engine, "pin", raising(gone))
    for path in ("trace", "events"):
        g = httpx.get(f"{server.url}/v1/requests/{rid}/{path}", headers=AUTH)
        assert g.status_code == 404 and g.json()["error"]["code"] == "request_not_found", g.text


def test_serve_command_drains_on_sigterm(tmp_path, stories_path):
    p = subprocess.Popen([sys.executable, "-m", "pagedecode.cli", "serve", "--model", str(stories_path),
                          "--port", "0", "--grace-seconds", "5"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    port = None
    for line in p.stdout:
        if "Uvicorn running on" in line:
            port = int(line.rsplit(":", 1)[1].split()[0])
            break
    assert port, "server did not start"
    url = f"http://127.0.0.1:{port}"
    assert httpx.get(url + "/health").status_code == 200
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 200,
                                                             "ignore_eos": True, "stream": True}) as r:
        lines = []
        for ln in r.iter_lines():
            lines.append(ln)
            if len(lines) == 4:
                p.send_signal(signal.SIGTERM)         # live request: it finishes within the grace
    items = sse([ln for ln in lines if ln])
    assert items[-1][1] == "[DONE]"
    finals = [d for _, d in items if isinstance(d, dict) and d.get("choices") and d["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"
    rest = p.stdout.read()
    assert p.wait(timeout=30) == 0
    assert "Application shutdown complete" in rest and "Traceback" not in rest


def test_streamed_first_token_timeout_is_an_error_chunk(server):
    """Reproduction: a stream whose first_token_timeout expires ended with a bare finish chunk;
    the client gets the error that says "first token" (the non-streaming answer's wording),
    then [DONE]."""
    body = {"prompt": "Once", "max_tokens": 5, "first_token_timeout": 1e-6}
    plain = httpx.post(server.url + "/v1/completions", headers=AUTH, json=body, timeout=30).json()
    with httpx.stream("POST", server.url + "/v1/completions", headers=AUTH, json={**body, "stream": True},
                      timeout=30) as r:
        assert r.status_code == 200
        items = sse([ln for ln in r.iter_lines() if ln])
    assert items[-1][1] == "[DONE]"
    errors = [d["error"] for _, d in items[:-1] if "error" in d]
    assert len(errors) == 1 and "first token" in errors[0]["message"]
    assert errors[0]["message"] == plain["pagedecode_error"]
    assert errors[0]["code"] == "deadline_exceeded"
    assert not any(d.get("choices") for _, d in items[:-1])       # no finish chunk besides the error


def test_output_ending_in_an_invalid_byte_is_a_replacement_character(server):
    """Reproduction over HTTP: stories260k forced (logit_bias) to end its output with the byte
    token <0xFF>: it failed with "output ends inside a UTF-8 character"; FF can never complete a
    character, so the text ends in U+FFFD, as the tokenizer decodes it, and the request finishes.
    Forced to end inside a real character (<0xE2>), it still fails, saying so."""
    tok = server.engine.tokenizer
    ff, e2 = (tok._tok.token_to_id(f"<0x{b:02X}>") for b in (0xFF, 0xE2))
    body = {"prompt": "Once upon a time", "max_tokens": 2, "temperature": 0, "logit_bias": {str(ff): 100}}
    r = httpx.post(server.url + "/v1/completions", headers=AUTH, json=body, timeout=30).json()
    assert r["choices"][0]["text"] == "\ufffd\ufffd" and r["choices"][0]["finish_reason"] == "length"
    assert "pagedecode_error" not in r
    with httpx.stream("POST", server.url + "/v1/completions", headers=AUTH, json={**body, "stream": True},
                      timeout=30) as s:
        items = sse([ln for ln in s.iter_lines() if ln])
    assert texts(items) == "\ufffd\ufffd" and not any("error" in d for _, d in items[:-1])
    r = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=30,
                   json={**body, "max_tokens": 1, "logit_bias": {str(e2): 100}}).json()
    assert "output ends inside a UTF-8 character" in r["pagedecode_error"]
