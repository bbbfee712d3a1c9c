"""What a request leaves behind is bounded: a finished request keeps neither its body (a chat
message's unrendered keys) nor its constraint (a schema's description), the server's Track lives
exactly as long as the engine keeps the request, and once the finished budget is full a long run
of requests, large ones mixed in, leaves the server's RSS where it was.

The server runs in this process (a thread), so the clients' own allocations would show in its
RSS: the request bodies are built once, before anything is measured. pagedecode sets glibc to
keep freed memory (csrc/cpu_forward.cpp), so RSS also holds the heap's high-water mark of
in-flight 900 KB bodies: it is compared once the budget is full and that mark reached."""
import gc
import json
import threading
import time
import tracemalloc

import httpx
import pytest

from .conftest import start_server, stop_server

BIG = 900_000       # a 900 KB string: a junk key or a schema description
LARGE_SCHEMAS = {"max_schema_bytes": 2 << 20}      # the default (32 KiB) refuses them at once


def chat_body(i, kind):
    msg = {"role": "user", "content": f"Lily {i}"}
    body = {"messages": [msg], "max_tokens": 1}
    if kind == "junk":
        msg["junk"] = "x" * BIG + str(i)                     # the template never renders it
    elif kind == "schema":
        body["max_tokens"] = 2
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "n", "schema": {
            "type": "object", "description": "d" * BIG + str(i), "properties": {"a": {"type": "integer"}}}}}
    elif kind == "stream":
        body["stream"] = True
    return json.dumps(body).encode()


def rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def send(url, bodies, start, count, clients=4, key_every=4):
    """count requests over `clients` keep-alive connections, body i % len(bodies); every
    key_every-th carries a fresh Idempotency-Key."""
    failures = []

    def client(j):
        with httpx.Client(base_url=url, timeout=120) as c:
            for i in range(start + j, start + count, clients):
                headers = {"content-type": "application/json"}
                if i % key_every == 1:
                    headers["idempotency-key"] = f"key-{i}"
                r = c.post("/v1/chat/completions", content=bodies[i % len(bodies)], headers=headers)
                if r.status_code != 200 or b'"error"' in r.content[:200]:
                    failures.append((i, r.status_code, r.text[:200]))
    threads = [threading.Thread(target=client, args=(j,)) for j in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[:3]


def test_a_finished_request_keeps_neither_its_body_nor_its_schema(stories_path):
    s = start_server(stories_path, engine_options=LARGE_SCHEMAS)
    try:
        with httpx.Client(base_url=s.url, timeout=120) as c:
            def post(body):
                r = c.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
                assert r.status_code == 200, r.text[:300]
            for i in range(4):                              # warm: the grammar compiler exists
                post(chat_body(i, "junk"))
                post(chat_body(i, "schema"))
            n = 16
            bodies = [chat_body(100 + i, kind) for i in range(n) for kind in ("junk", "schema")]
            engine_before = s.engine.requests.finished_bytes
            gc.collect()
            tracemalloc.start()
            try:
                before = tracemalloc.get_traced_memory()[0]
                for body in bodies:
                    post(body)
                del body
                gc.collect()
                kept = (tracemalloc.get_traced_memory()[0] - before) / len(bodies)
            finally:
                tracemalloc.stop()
        estimated = (s.engine.requests.finished_bytes - engine_before) / len(bodies)
        # each used to keep ~0.9 MB (the message in its Track) or ~1.9 MB (the schema twice)
        print(f"\nkept per finished request {kept:.0f} bytes, the budget counts {estimated:.0f}")
        assert kept < 25_000, kept
        assert 0.7 < estimated / kept < 1.4, (estimated, kept)   # the budget counts what it keeps
        rid = next(reversed(s.engine.requests._finished))
        assert s.engine.requests.get(rid).params.structured_output is None
        assert s.state.tracks[rid].request_id == rid and not hasattr(s.state.tracks[rid], "parsed")
    finally:
        stop_server(s)


def test_a_track_lives_as_long_as_the_engine_keeps_its_request(stories_path):
    s = start_server(stories_path, engine_options={"max_finished_kept": 5})
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            rids = []
            for i in range(12):
                r = c.post("/v1/completions", json={"prompt": f"Once {i}", "max_tokens": 1})
                rids.append(r.headers["x-request-id"])
            gc.collect()
            assert sorted(s.state.tracks.keys()) == sorted(rids[-5:])
            r = c.get(f"/v1/requests/{rids[0]}/events")
            assert r.status_code == 404 and r.json()["error"]["code"] == "request_not_found"   # its Track went too
            r = c.get(f"/v1/requests/{rids[-1]}/events")
            assert r.status_code == 200 and "[DONE]" in r.text
            big = c.post("/v1/completions", json={"prompt": "x"}, headers={"Idempotency-Key": "k" * 256})
            assert big.status_code == 400 and big.json()["error"]["param"] == "Idempotency-Key"
    finally:
        stop_server(s)


def soak(stories_path, requests, fill):
    """Fill the finished budget (and, with `fill`, the step records), then `requests` more (a
    tenth with a 900 KB junk key, a tenth with a 900 KB schema description, a tenth streamed, a
    quarter with an Idempotency-Key): RSS stays within 5%, and every per-request store stays at
    its cap (forgotten ids grow towards theirs, 100,000 of ~170 bytes)."""
    budget, max_keys = 4 << 20, 300
    s = start_server(stories_path, engine_options={"max_finished_bytes": budget, **LARGE_SCHEMAS},
                     idempotency_max_keys=max_keys)
    try:
        kinds = ["junk", "plain", "plain", "stream", "plain", "schema", "plain", "plain", "plain", "plain"]
        bodies = [chat_body(i, kinds[i % 10]) for i in range(200)]
        t = time.perf_counter()
        send(s.url, bodies, 0, fill)                 # past the budget, and the peak of in-flight bodies
        fill_rate = fill / (time.perf_counter() - t)
        reg = s.engine.requests
        assert reg.finished_bytes <= budget and reg.num_finished < fill and len(s.state.keys) >= max_keys
        gc.collect()
        before = rss_bytes()
        t = time.perf_counter()
        send(s.url, bodies, fill, requests)
        rate = requests / (time.perf_counter() - t)
        gc.collect()
        after = rss_bytes()
        mib = 2 ** 20
        print(f"\nsoak: {requests} requests at {rate:.0f}/s (fill {fill} at {fill_rate:.0f}/s): RSS {before / mib:.0f} -> "
              f"{after / mib:.0f} MiB ({(after - before) / mib:+.1f}); finished {reg.num_finished} "
              f"({reg.finished_bytes / mib:.2f} MiB), tracks {len(s.state.tracks)}, keys {len(s.state.keys)}, "
              f"forgotten ids {len(reg._forgotten)}, step records {len(s.engine.step_records)}")
        assert after < 1.05 * before
        assert reg.finished_bytes <= budget and not reg.live
        assert len(s.state.tracks) == reg.num_finished           # a Track goes with its request
        assert len(s.state.keys) <= max_keys + 1
    finally:
        stop_server(s)


def test_soak_two_thousand_requests_leave_rss_where_it_was(stories_path):
    soak(stories_path, 2_000, fill=1_600)


@pytest.mark.slow
def test_soak_twenty_thousand_requests_leave_rss_where_it_was(stories_path):
    soak(stories_path, 20_000, fill=6_000)        # 6,000: the step records are at their cap (4,096)
