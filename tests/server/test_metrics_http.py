"""/metrics reads the engine's gauges and counters from `engine.snapshot()` at scrape time: the
values a scrape shows are the snapshot's, with vLLM's names and a counter's `_total`."""
import threading
import time

import httpx

from .conftest import start_server, stop_server

PROMPTS = ["Once upon a time", "Lily and Tom", "The cat", "Tom had a big red ball"]
ENGINE = ("pagedecode:num_requests_running", "pagedecode:num_requests_waiting", "pagedecode:kv_cache_usage_perc",
          "pagedecode:num_preemptions_total", "pagedecode:prefix_cache_queries_total",
          "pagedecode:prefix_cache_hits_total")


def scrape(url):
    text = httpx.get(url + "/metrics").text
    return {k: float(v) for k, v in (ln.rsplit(" ", 1) for ln in text.splitlines()
                                     if ln.startswith("pagedecode:"))}, text


def as_metrics(s):
    return dict(zip(ENGINE, (s.running, s.waiting, s.pages_used / s.pages_total, s.preemptions,
                             s.prefix_cache_queries, s.prefix_cache_hits)))


def test_metrics_are_the_engines_snapshot(stories_path):
    # 8 pages of 8 tokens for 4 requests of up to 45 tokens: they preempt each other
    s = start_server(stories_path, template=None, engine_options={"max_cache_tokens": 64, "page_size": 8})
    try:
        eng = s.engine
        body = {"max_tokens": 40, "ignore_eos": True, "temperature": 0}
        during = []

        def scrape_meanwhile():               # counters only grow: each scrape lies between two snapshots
            while not done.is_set():
                before = eng.snapshot()
                m, _ = scrape(s.url)
                during.append((before, m, eng.snapshot()))
        done = threading.Event()
        watcher = threading.Thread(target=scrape_meanwhile)
        watcher.start()
        try:                                  # one batched request: the four enter the engine together
            r = httpx.post(s.url + "/v1/completions", json={**body, "prompt": PROMPTS}, timeout=120)
            assert r.status_code == 200 and len(r.json()["choices"]) == len(PROMPTS), r.text
            for _ in range(2):                # the same prompt again: its full pages come from the cache
                httpx.post(s.url + "/v1/completions", json={**body, "prompt": PROMPTS[3]}, timeout=120)
        finally:
            done.set()
            watcher.join()
        deadline = time.monotonic() + 30
        while eng.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.02)
        snap = eng.snapshot()
        m, text = scrape(s.url)
        assert {k: m[k] for k in ENGINE} == as_metrics(snap)
        assert snap.preemptions > 0 and snap.prefix_cache_hits > 0 and snap.running == snap.waiting == 0
        for name in ENGINE:                   # names and types as before (a counter's family is NAME_total)
            kind = "counter" if name.endswith("_total") else "gauge"
            assert f"# TYPE {name} {kind}" in text
        assert during
        for before, seen, after in during:
            for k in ENGINE[3:]:
                assert as_metrics(before)[k] <= seen[k] <= as_metrics(after)[k]
    finally:
        stop_server(s)
