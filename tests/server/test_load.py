"""Many concurrent streaming clients, a third leaving at random points, some resuming: afterwards
every page and slot is free, each request ended exactly once, the metrics equal what the clients
saw, and every completed client's text equals the non-streamed result for the same seed."""
import asyncio
import json
import random
import re

import httpx
from .conftest import start_server, stop_server

CLIENTS = 210


async def one(client, url, i, rng, outcomes):
    body = {"prompt": ["Once upon a time", "Lily", "The dog", "Tom and Sue"][i % 4], "max_tokens": 24,
            "temperature": 1.0, "seed": i, "stream": True, "stream_options": {"include_usage": True}}
    leave_after = rng.randint(1, 12) if i % 3 == 0 else None
    resume = leave_after is not None and i % 2 == 0
    if resume:
        body["on_disconnect"] = "continue"
    text, last_id, rid, done = "", -1, None, False
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        rid = r.headers["x-request-id"]
        n = 0
        async for ln in r.aiter_lines():
            if ln.startswith("id: "):
                last_id = int(ln[4:])
            elif ln.startswith("data: ") and ln != "data: [DONE]":
                d = json.loads(ln[6:])
                if d.get("choices"):
                    text += d["choices"][0]["text"]
                n += 1
                if leave_after is not None and n >= leave_after:
                    break
            elif ln == "data: [DONE]":
                done = True
    if not done and resume:
        async with client.stream("GET", f"{url}/v1/requests/{rid}/events",
                                 headers={"Last-Event-ID": str(last_id)}) as r:
            async for ln in r.aiter_lines():
                if ln.startswith("data: ") and ln != "data: [DONE]":
                    d = json.loads(ln[6:])
                    if d.get("choices"):
                        text += d["choices"][0]["text"]
                elif ln == "data: [DONE]":
                    done = True
    outcomes[i] = (rid, text, done, body)


def scrape(text):
    out = {}
    for line in text.splitlines():
        m = re.match(r'(pagedecode:[a-z_]+(?:\{[^}]*\})?) ([0-9.e+-]+)$', line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def test_two_hundred_streaming_clients(stories_path):
    s = start_server(stories_path, template=None, max_queued_requests=1000)
    try:
        outcomes = {}
        rng = random.Random(5)

        async def main():
            limits = httpx.Limits(max_connections=CLIENTS + 10, max_keepalive_connections=CLIENTS + 10)
            async with httpx.AsyncClient(timeout=120, limits=limits) as client:
                await asyncio.gather(*(one(client, s.url, i, rng, outcomes) for i in range(CLIENTS)))
        asyncio.run(main())
        eng = s.engine
        for _ in range(400):
            if not eng.has_unfinished() and all(t.metered for t in s.state.tracks.values()):
                break
            asyncio.run(asyncio.sleep(0.05))
        assert not eng.has_unfinished()
        assert eng.pool.free_pages == eng.pool.num_pages and eng.slots.free_slots == eng.slots.num_slots
        results = {i: eng.result(rid) for i, (rid, _, _, _) in outcomes.items()}
        for i, (rid, text, done, body) in outcomes.items():
            out = results[i]
            assert out.state.terminal
            terminals = [e for e in eng.replay(rid) if type(e).__name__ == "TerminalEvent"]
            assert len(terminals) == 1                                     # ended exactly once
            if done:
                assert text == out.text
            else:
                # a client that left is cancelled as transport_error, unless its request had already
                # ended (every event sent into the socket) before the server saw it go
                assert out.text.startswith(text)
                assert out.finish_reason.value in ("transport_error", "max_output_tokens", "eos"), out.finish_reason
        completed = [i for i, o in outcomes.items() if o[2]]
        left = [i for i, o in outcomes.items() if not o[2]]
        assert len(left) >= CLIENTS // 7 and len(completed) >= CLIENTS // 2
        cut = [i for i in left if results[i].finish_reason.value == "transport_error"]
        assert cut, "no client left while its request was still generating"
        resumed = sum(1 for t in s.state.tracks.values() if t.resumes)
        print(f"\nload: {CLIENTS} clients, {len(completed)} completed ({resumed} after resuming), "
              f"{len(left)} left for good; {sum(r.usage.returned_tokens for r in results.values())} tokens returned")
        m = scrape(httpx.get(s.url + "/metrics").text)
        assert m["pagedecode:generation_tokens_total"] == sum(r.usage.returned_tokens for r in results.values())
        assert m["pagedecode:prompt_tokens_total"] == sum(r.usage.prompt_tokens for r in results.values())
        by_reason = {}
        for r in results.values():
            by_reason[r.finish_reason.value] = by_reason.get(r.finish_reason.value, 0) + 1
        for reason, count in by_reason.items():
            if reason in ("eos", "stop_sequence", "max_output_tokens", "context_limit"):
                assert m[f'pagedecode:request_success_total{{finished_reason="{reason}"}}'] == count
            else:
                assert m[f'pagedecode:request_failure_total{{reason="{reason}"}}'] == count
        assert m["pagedecode:disconnects_total"] >= len(cut)
        # the same seed, not streamed and alone, gives the same text
        for i in completed[:12]:
            body = {**outcomes[i][3], "stream": False}
            body.pop("stream_options")
            r = httpx.post(s.url + "/v1/completions", json=body, timeout=60).json()
            assert r["choices"][0]["text"] == outcomes[i][1]
    finally:
        stop_server(s)
