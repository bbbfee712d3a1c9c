"""Hostile structured-output requests never stall the others (issue 19): a schema nested 400
deep used to stall /health and every stream for 5 s, parsed on the event loop under the engine's
lock. A real server, a client streaming greedy tokens, another posting the schema."""
import hashlib
import threading
import time

import httpx
import pytest

from .conftest import start_server, stop_server

pytest.importorskip("xgrammar")
AUTH = {"Authorization": "Bearer sekret"}


def nested(depth, key="items"):
    schema = {"type": "string"}
    for _ in range(depth):
        schema = ({"type": "array", "items": schema} if key == "items"
                  else {"type": "object", "properties": {"a": schema}, "required": ["a"]})
    return schema


def schema_body(schema, **kw):
    return {"prompt": "Once", "max_tokens": 8, **kw,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


@pytest.mark.parametrize("body, param, limit", [
    # the body's own depth limit (64 levels) answers first; the engine's max_schema_depth is the
    # same bound for the Python API (tests/runtime/test_structured.py)
    (schema_body(nested(400)), "response_format", "nested deeper than 64 levels"),
    (schema_body(nested(400, "properties")), "response_format", "nested deeper than 64 levels"),
    ({"prompt": "Once", "structured_outputs": {"choice": [f"option number {i}" for i in range(20_000)]}},
     "structured_outputs", "max_schema_bytes=32768"),
    (schema_body({"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(2000)}}),
     "response_format", "max_schema_bytes=32768"),
])
def test_a_hostile_constraint_is_refused_naming_the_limit(server, body, param, limit):
    r = httpx.post(server.url + "/v1/completions", headers=AUTH, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and limit in err["message"], err
    assert httpx.get(server.url + "/health").status_code == 200


def test_the_server_imports_xgrammar_as_it_starts_serving(stories_path):
    """The import (~1 s of CPU, transformers with it) holds the GIL in bursts of up to ~300 ms in
    any thread: done as the server starts, before any constrained request (issue 19), but no
    longer before /health answers (issue 36: serve ready within 3 s)."""
    s = start_server(stories_path, warm_grammar=False)
    try:
        assert httpx.get(s.url + "/health").status_code == 200
        deadline = time.monotonic() + 60
        while s.engine.constraints.compiler.xgr is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.engine.constraints.compiler.xgr is not None        # no constrained request asked for it
    finally:
        stop_server(s)


def test_an_invalid_grammar_is_still_a_400_naming_the_field(server):
    r = httpx.post(server.url + "/v1/completions", headers=AUTH,
                   json={"prompt": "Once", "structured_outputs": {"regex": "a(b"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text
    r = httpx.post(server.url + "/v1/completions", headers=AUTH, json=schema_body({"type": "strin"}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text


class Watch:
    """Streams greedy completions back to back and polls /health until stopped; records the
    longest wait between two tokens (across streams too: a stall between them counts) and
    /health's latencies."""

    def __init__(self, url):
        self.url, self.stop = url, threading.Event()
        self.gaps, self.health = [], []
        self.threads = [threading.Thread(target=self._stream), threading.Thread(target=self._poll)]

    def __enter__(self):
        for t in self.threads:
            t.start()
        deadline = time.time() + 30
        while len(self.gaps) < 20 and time.time() < deadline:     # streaming has begun
            time.sleep(0.01)
        self.gaps.clear()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)

    def _stream(self):
        body = {"prompt": "Once upon a time", "max_tokens": 300, "temperature": 0, "ignore_eos": True,
                "stream": True}
        last = None
        with httpx.Client(headers=AUTH, timeout=60) as c:
            while not self.stop.is_set():
                with c.stream("POST", self.url + "/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            now = time.perf_counter()
                            if last is not None:
                                self.gaps.append(now - last)
                            last = now
                        if self.stop.is_set():
                            break

    def _poll(self):
        with httpx.Client(timeout=60) as c:
            while not self.stop.is_set():
                t = time.perf_counter()
                assert c.get(self.url + "/health").status_code == 200
                self.health.append(time.perf_counter() - t)
                time.sleep(0.02)


class Burner:
    """A thread that keeps a core busy without holding the GIL (hashlib releases it), as the
    grammar worker does while it parses and compiles."""

    def __init__(self):
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._burn)

    def _burn(self):
        data = b"x" * (1 << 20)
        while not self.stop.is_set():
            hashlib.sha256(data).digest()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def test_a_schema_compiled_for_seconds_never_stalls_another_stream(stories_path, monkeypatch):
    """The limits raised so that a schema nested 250 deep is parsed and compiled (seconds of
    work in the grammar workers): another client's longest wait between tokens stays under
    100 ms (next to a baseline measured the same way), and /health answers throughout."""
    from pagedecode.server import jsonbody
    monkeypatch.setattr(jsonbody, "MAX_DEPTH", 1000)
    s = start_server(stories_path, api_key="sekret",
                     engine_options=dict(max_schema_depth=10_000, max_schema_bytes=1 << 20))
    try:
        with Watch(s.url) as base, Burner():         # the same load: a core busy outside the GIL
            time.sleep(1.5)
        with Watch(s.url) as hostile, httpx.Client(headers=AUTH, timeout=120) as c:
            t = time.perf_counter()
            r = c.post(s.url + "/v1/completions", json=schema_body(nested(250), max_tokens=4))
            took = time.perf_counter() - t
            n_health = len(hostile.health)
    finally:
        stop_server(s)
    assert r.status_code == 200, r.text
    report = (f"hostile request {took:.2f} s; longest wait between tokens {max(hostile.gaps) * 1e3:.0f} ms "
              f"(baseline {max(base.gaps) * 1e3:.0f} ms); /health slowest {max(hostile.health) * 1e3:.0f} ms "
              f"(baseline {max(base.health) * 1e3:.0f} ms), {n_health} answers")
    print(report)
    assert took > 0.3, report                     # it did take long enough to measure anything
    # < 100 ms on idle cores (42 ms measured; it was the whole parse, 1.4 s, before); a machine
    # busy with other work slows the baseline too, hence the margin over it
    assert max(hostile.gaps) < max(0.1, 2 * max(base.gaps)), report
    # /health answers throughout; one slow answer on a loaded machine (134 ms seen in a full run
    # beside a benchmark) is not the stall, which held every answer for the whole 1.4 s parse
    assert max(hostile.health) < max(0.25, 2 * max(base.health)) and n_health >= took / 0.1, report
