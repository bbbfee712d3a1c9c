"""Parsing, rendering and tokenizing run off the event loop, after cheap bounds: two clients
looping 900 KB chat bodies (each answered 400) raised everyone's latency from 42 ms to 3.1 s
p50 and stalled streams by up to 4.4 s; 150,000 stop_token_ids cost 0.93 s before a 400 that
named `stop` (issue: the edges, second round)."""
import json
import threading
import time

import httpx

from .conftest import start_server, stop_server

BIG = json.dumps({"model": "stories260k", "max_tokens": 4,
                  "messages": [{"role": "user", "content": "Lily went to the park. " * 39_000}]})   # ~900 KB


def test_big_chat_bodies_are_refused_cheaply_and_stall_no_one(stories_path):
    s = start_server(stories_path)
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            t0 = time.perf_counter()
            r = c.post("/v1/chat/completions", content=BIG, headers={"content-type": "application/json"})
            first = time.perf_counter() - t0
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
            assert "context" in r.json()["error"]["message"]
            baseline = []
            for _ in range(10):
                t0 = time.perf_counter()
                assert c.get("/health").status_code == 200
                baseline.append(time.perf_counter() - t0)
        stop, answers = threading.Event(), []

        def hammer():
            with httpx.Client(base_url=s.url, timeout=60) as c:
                while not stop.is_set():
                    answers.append(c.post("/v1/chat/completions", content=BIG,
                                          headers={"content-type": "application/json"}).status_code)

        clients = [threading.Thread(target=hammer) for _ in range(2)]
        for t in clients:
            t.start()
        # measure only once the big bodies are flowing: the stream and the health checks below take
        # well under a second, less than one 900 KB round trip on a loaded machine (answers was
        # empty once: nothing had been measured against)
        deadline = time.monotonic() + 30
        while len(answers) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        busy, gaps = [], []
        try:
            with httpx.Client(base_url=s.url, timeout=60) as c:
                body = {"model": "stories260k", "prompt": "Once upon a time", "max_tokens": 40, "stream": True}
                with c.stream("POST", "/v1/completions", json=body) as r:
                    last = time.perf_counter()
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            now = time.perf_counter()
                            gaps.append(now - last)
                            last = now
                for _ in range(20):
                    t0 = time.perf_counter()
                    assert c.get("/health").status_code == 200
                    busy.append(time.perf_counter() - t0)
        finally:
            stop.set()
            for t in clients:
                t.join()
        assert answers and set(answers) == {400}
        assert first < 1.0                       # refused before tokenizing (was ~1.5 s for 900 KB)
        busy.sort()
        # within 100 ms of the baseline at the median (was 3.1 s), and no second-long stall
        assert busy[len(busy) // 2] < sorted(baseline)[5] + 0.1, (busy, baseline)
        assert max(busy) < 1.0 and max(gaps[1:]) < 1.0, (busy, gaps)
    finally:
        stop_server(s)


def test_many_stop_token_ids_are_refused_at_once_naming_the_field(stories_path):
    s = start_server(stories_path)
    try:
        body = {"model": "stories260k", "prompt": "Hi", "stop_token_ids": list(range(150_000))}
        t0 = time.perf_counter()
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
        took = time.perf_counter() - t0
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids", r.text
        assert took < 0.5, took                  # was 0.93 s of checking every id first
    finally:
        stop_server(s)
