"""Resuming a stream at, past and before its end, byte-identical replays, and results kept for
the clients that have yet to receive them (issue 19, items 5 and 6)."""
import concurrent.futures
import json
import time

import httpx
import pytest

from .conftest import start_server, stop_server


@pytest.fixture(scope="module")
def small(stories_path):
    """A server that keeps only 2 finished requests readable."""
    s = start_server(stories_path, engine_options={"max_finished_kept": 2})
    yield s
    stop_server(s)


def frames(raw):
    """The SSE frames of a body, each as its text without the blank line."""
    return [f for f in raw.split("\n\n") if f]


def frame_id(frame):
    head = frame.split("\n", 1)[0]
    return int(head[4:]) if head.startswith("id: ") else None


def stream(s, path, body=None, headers=None, timeout=30):
    """(status, whole body as text, seconds until the body ended)."""
    t0 = time.perf_counter()
    method = "POST" if body is not None else "GET"
    with httpx.stream(method, s.url + path, json=body, headers=headers or {}, timeout=timeout) as r:
        raw = "".join(r.iter_text())
        return r.status_code, raw, time.perf_counter() - t0, r.headers.get("x-request-id")


@pytest.mark.parametrize("chat", [False, True])
def test_a_replay_is_byte_identical_to_the_original(small, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"max_tokens": 24, "stream": True, "logprobs": True if chat else 2, "seed": 3, "temperature": 1.0,
            "stream_options": {"include_usage": True}, "on_disconnect": "continue"}
    if chat:
        body.update(messages=[{"role": "user", "content": "Once upon a time"}], top_logprobs=2)
    else:
        body["prompt"] = "Once upon a time"
    status, original, _, rid = stream(small, path, body)
    assert status == 200
    time.sleep(1.1)                      # a replay built with a new `created` would differ now
    status, whole, _, _ = stream(small, f"/v1/requests/{rid}/events?after=-1")
    assert status == 200 and whole == original
    fs = frames(original)
    assert all(frame_id(f) is not None for f in fs[:-1]) and fs[-1] == "data: [DONE]"   # every data chunk has an id
    ids = [frame_id(f) for f in fs[:-1]]
    assert ids == sorted(set(ids))
    middle = ids[len(ids) // 2]
    status, rest, _, _ = stream(small, f"/v1/requests/{rid}/events", headers={"Last-Event-ID": str(middle)})
    assert status == 200 and frames(rest) == fs[ids.index(middle) + 1:]


def test_resume_at_the_end_sends_what_remains_at_once(small):
    body = {"prompt": "Once upon a time", "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True}, "on_disconnect": "continue"}
    status, original, _, rid = stream(small, "/v1/completions", body)
    fs = frames(original)
    usage, finish = fs[-2], fs[-3]
    terminal = frame_id(finish)
    assert json.loads(usage.split("data: ", 1)[1])["usage"] and frame_id(usage) == terminal + 1
    # a client that lost [DONE] after the finish chunk, or after the usage chunk
    status, rest, took, _ = stream(small, f"/v1/requests/{rid}/events", headers={"Last-Event-ID": str(terminal)},
                                   timeout=10)
    assert status == 200 and frames(rest) == [usage, "data: [DONE]"] and took < 5
    status, rest, _, _ = stream(small, f"/v1/requests/{rid}/events", headers={"Last-Event-ID": str(terminal + 1)},
                                timeout=10)
    assert status == 200 and frames(rest) == ["data: [DONE]"]
    # an id no chunk carried, and ids that are not ids
    for headers, query, param in [({"Last-Event-ID": str(terminal + 2)}, "", "Last-Event-ID"),
                                  ({"Last-Event-ID": "abc"}, "", "Last-Event-ID"),
                                  ({"Last-Event-ID": "-7"}, "", "Last-Event-ID"),
                                  ({}, "?after=1.5", "after")]:
        r = httpx.get(f"{small.url}/v1/requests/{rid}/events{query}", headers=headers, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (headers, query, r.text)


def test_resume_at_the_end_without_usage_and_of_a_live_request(small):
    body = {"prompt": "Once upon a time", "max_tokens": 6, "stream": True, "on_disconnect": "continue"}
    _, original, _, rid = stream(small, "/v1/completions", body)
    terminal = frame_id(frames(original)[-2])
    status, rest, took, _ = stream(small, f"/v1/requests/{rid}/events", headers={"Last-Event-ID": str(terminal)},
                                   timeout=10)
    assert status == 200 and frames(rest) == ["data: [DONE]"] and took < 5
    r = httpx.get(f"{small.url}/v1/requests/{rid}/events", headers={"Last-Event-ID": str(terminal + 1)})
    assert r.status_code == 400 and "Last-Event-ID" in r.json()["error"]["message"]
    # a live request: an id beyond what it has sent so far is refused too
    live = {"prompt": "Once", "max_tokens": 2000, "ignore_eos": True, "stream": True, "on_disconnect": "continue"}
    with httpx.stream("POST", small.url + "/v1/completions", json=live, timeout=30) as r:
        rid = r.headers["x-request-id"]
        for ln in r.iter_lines():
            if ln.startswith("id: 2"):
                break
    r = httpx.get(f"{small.url}/v1/requests/{rid}/events", headers={"Last-Event-ID": "100000"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "Last-Event-ID"
    small.engine.cancel(rid)


def test_results_are_kept_until_sent(small):
    """max_finished_kept=2: n=4 and 8 concurrent requests used to lose results (500)."""
    r = httpx.post(small.url + "/v1/completions", json={"prompt": "Once", "max_tokens": 16, "n": 4, "seed": 1},
                   timeout=60)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3] and all(c["text"] for c in choices)

    def one(i):
        if i % 2:
            body = {"prompt": f"Lily {i}", "max_tokens": 12 + i, "stream": True}
            with httpx.stream("POST", small.url + "/v1/completions", json=body, timeout=60) as s:
                return s.status_code, frames("".join(s.iter_text()))[-1]
        r = httpx.post(small.url + "/v1/completions", json={"prompt": f"Lily {i}", "max_tokens": 12 + i}, timeout=60)
        return r.status_code, r.json()["choices"][0]["finish_reason"]
    for _ in range(2):
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(one, range(8)))
        assert all(code == 200 for code, _ in got), got
        assert all(end == "data: [DONE]" for code, end in got[1::2]), got
    deadline = time.time() + 10
    while small.engine.requests.num_finished > 2 and time.time() < deadline:
        time.sleep(0.05)
    assert small.engine.requests.num_finished <= 2          # pins released: the budget holds again
