"""Batched prompts on /v1/completions (issue 21, item 3): a list of strings or of id lists is one
response whose choices are prompt-major (prompt i, sample j -> index i * n + j), streamed or not,
usage summed; each prompt is its own engine request, all cancelled when the client goes away."""
import json
import time

import httpx
import pytest

from .conftest import slow_steps, start_server, stop_server

openai = pytest.importorskip("openai")

PROMPTS = ["Once upon a time", "Lily", "The cat"]
REF = ", there was a little girl named Lily. She loved to play"     # stories260k greedy, 16 tokens


@pytest.fixture(scope="module")
def srv(stories_path):
    s = start_server(stories_path, max_prompts_per_request=4)
    yield s
    stop_server(s)


@pytest.fixture()
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


def sse_chunks(raw):
    """The JSON chunks of an SSE body (and whether it ended in [DONE]), each with its SSE id."""
    out, done = [], False
    for frame in (f for f in raw.split("\n\n") if f):
        lines = frame.split("\n")
        sid = int(lines[0][4:]) if lines[0].startswith("id: ") else None
        data = lines[-1][6:]
        if data == "[DONE]":
            done = True
        else:
            out.append((sid, json.loads(data)))
    return out, done


def wait_idle(engine, timeout=30):
    deadline = time.time() + timeout
    while engine.has_unfinished() and time.time() < deadline:
        time.sleep(0.05)
    assert not engine.has_unfinished()


@pytest.mark.parametrize("as_ids", [False, True])
def test_batch_choices_are_prompt_major_and_equal_single_requests(client, srv, as_ids):
    tok = srv.engine.tokenizer
    prompt = [list(tok.encode(p)) for p in PROMPTS] if as_ids else PROMPTS
    kw = dict(model="stories260k", max_tokens=8, n=2, temperature=1.0, seed=3)
    r = client.completions.create(prompt=prompt, **kw)
    assert [c.index for c in r.choices] == list(range(6))
    singles = [client.completions.create(prompt=p, **kw) for p in prompt]
    for i, one in enumerate(singles):
        for j in range(2):          # prompt i, sample j (seeded seed + j, as the prompt alone)
            assert r.choices[i * 2 + j].text == one.choices[j].text
            assert r.choices[i * 2 + j].finish_reason == one.choices[j].finish_reason
    assert r.choices[0].text != r.choices[1].text or r.choices[2].text != r.choices[3].text
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)      # each prompt once
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles) == 48
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    greedy = client.completions.create(model="stories260k", prompt=[PROMPTS[0]] * 2, max_tokens=16)
    assert [c.text for c in greedy.choices] == [REF, REF]


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_choices_carry_their_index_and_all_finish(client, srv, chat):
    if chat:
        body = {"messages": [{"role": "user", "content": "Lily"}], "n": 3, "max_tokens": 8,
                "temperature": 1.0, "seed": 5}
        path, n, count = "/v1/chat/completions", 3, 3
    else:
        body = {"prompt": PROMPTS, "n": 2, "max_tokens": 8, "temperature": 1.0, "seed": 5, "logprobs": 1}
        path, n, count = "/v1/completions", 2, 6
    whole = httpx.post(srv.url + path, json=body, timeout=60).json()
    with httpx.stream("POST", srv.url + path, timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200, r.read()
        chunks, done = sse_chunks("".join(r.iter_text()))
    assert done and all(sid is None for sid, _ in chunks)      # a merged stream: no SSE ids
    texts, finishes, roles, offsets = [""] * count, [[] for _ in range(count)], [], [[] for _ in range(count)]
    for _, c in chunks[:-1]:
        (ch,) = c["choices"]
        assert c["id"] == whole["id"] or c["id"].startswith("req-")
        delta = ch["delta"] if chat else ch
        if chat and delta.get("role"):
            roles.append(ch["index"])
        texts[ch["index"]] += delta.get("content" if chat else "text") or ""
        if ch["finish_reason"]:
            finishes[ch["index"]].append(ch["finish_reason"])
        if ch["logprobs"]:                           # each choice's text_offset goes on from its own text
            offsets[ch["index"]] += ch["logprobs"]["text_offset"]
    if chat:
        assert roles == list(range(count))
    assert all(len(f) == 1 for f in finishes), finishes          # every choice finishes, once
    key = "message" if chat else None
    assert texts == [c[key]["content"] if key else c["text"] for c in whole["choices"]]
    if not chat:
        assert offsets == [c["logprobs"]["text_offset"] for c in whole["choices"]]
    usage = chunks[-1][1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    assert usage["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    # the openai client reads it too
    if not chat:
        got = [""] * count
        for c in client.completions.create(model="stories260k", stream=True, **body):
            for ch in c.choices:
                got[ch.index] += ch.text
        assert got == texts


@pytest.mark.parametrize("stream", [True, False])
def test_client_leaving_cancels_every_prompt(srv, stream):
    before = set(srv.state.tracks.keys())
    body = {"prompt": PROMPTS, "max_tokens": 400, "ignore_eos": True, "temperature": 1.0, "seed": 1,
            "stream": stream}
    with slow_steps(srv.engine):            # the requests still run when the client leaves
        if stream:
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
                assert r.status_code == 200
                for n, line in enumerate(r.iter_lines()):
                    if n >= 6:
                        break                    # leaves mid-stream
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(srv.url + "/v1/completions", json=body, timeout=0.5)
        ids = set(srv.state.tracks.keys()) - before
        assert len(ids) == 3
        wait_idle(srv.engine)
    for rid in ids:
        out = srv.engine.result(rid)
        assert out.state.value == "cancelled" and out.finish_reason.value == "transport_error", rid
        assert out.usage.returned_tokens < 400
    assert srv.engine.pool.free_pages == srv.engine.pool.num_pages
    assert not srv.engine.scheduler.running and not srv.engine.scheduler.waiting


def test_caps_and_bad_batches_name_the_field(srv):
    def err(body):
        r = httpx.post(srv.url + "/v1/completions", json={"max_tokens": 4, **body}, timeout=30)
        assert r.status_code == 400, r.text
        return r.json()["error"]
    e = err({"prompt": ["a"] * 5})                            # --max-prompts-per-request 4 here
    assert e["param"] == "prompt" and "at most 4 prompts" in e["message"]
    e = err({"prompt": ["a"] * 2, "n": 9})                    # 18 choices > max(16, 4)
    assert e["param"] == "n" and "18 choices" in e["message"]
    for bad in ([], ["a", ""], ["a", []], ["a", 3], [[1, "x"]], ["a", [1, True]]):
        assert err({"prompt": bad})["param"] == "prompt", bad
    e = err({"prompt": ["Once", [1, 10 ** 6]]})               # the engine's check, after the first started
    assert e["param"] == "prompt"
    wait_idle(srv.engine)
    assert srv.engine.pool.free_pages == srv.engine.pool.num_pages
    ok = httpx.post(srv.url + "/v1/completions", json={"prompt": ["a"] * 4, "n": 4, "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 16


def test_a_batch_of_one_is_the_single_prompt(client, srv):
    for prompt in (["Once upon a time"], [list(srv.engine.tokenizer.encode("Once upon a time"))]):
        r = client.completions.create(model="stories260k", prompt=prompt, max_tokens=16)
        assert [c.text for c in r.choices] == [REF] and r.usage.prompt_tokens == 5
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=30,
                      json={"prompt": ["Once upon a time"], "max_tokens": 16, "stream": True}) as r:
        chunks, done = sse_chunks("".join(r.iter_text()))
    assert done and all(sid is not None for sid, _ in chunks)     # the one-request stream, resumable
    assert "".join(c["choices"][0]["text"] for _, c in chunks) == REF


def test_idempotent_retry_attaches_to_every_prompt(srv):
    h = {"Idempotency-Key": "batch-1"}
    body = {"prompt": PROMPTS, "n": 2, "max_tokens": 6, "temperature": 1.0, "seed": 2}
    a = httpx.post(srv.url + "/v1/completions", json=body, headers=h, timeout=60)
    kept = len(srv.state.tracks)
    b = httpx.post(srv.url + "/v1/completions", json=body, headers=h, timeout=60)
    assert a.status_code == b.status_code == 200 and a.json() == b.json()
    assert len(srv.state.tracks) == kept                      # no new requests
    h = {"Idempotency-Key": "batch-2"}
    sbody = {**body, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/completions", json=sbody, headers=h, timeout=60) as r:
        first = sse_chunks("".join(r.iter_text()))
    with httpx.stream("POST", srv.url + "/v1/completions", json=sbody, headers=h, timeout=60) as r:
        again = sse_chunks("".join(r.iter_text()))

    def texts(chunks):
        out = [""] * 6
        for _, c in chunks[0]:
            for ch in c["choices"]:
                out[ch["index"]] += ch["text"]
        return out
    assert texts(again) == texts(first) == [c["text"] for c in a.json()["choices"]]
    r = httpx.post(srv.url + "/v1/completions", json=sbody, headers={**h, "Last-Event-ID": "3"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "Last-Event-ID"
    assert r.json()["error"]["code"] == "resume_not_supported"


def test_serve_flag():
    import argparse

    from pagedecode.server.flags import add_arguments
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).max_prompts_per_request == 64
    assert p.parse_args(["--max-prompts-per-request", "8"]).max_prompts_per_request == 8


def test_admission_counts_every_request_of_a_batch(stories_path):
    s = start_server(stories_path, template=None, max_queued_requests=3, engine_options={"max_batch_size": 1})
    try:
        long = {"prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=long, timeout=60) as a, \
                httpx.stream("POST", s.url + "/v1/completions", json=long, timeout=60) as b:
            assert a.status_code == b.status_code == 200
            deadline = time.time() + 20
            while len(s.engine.scheduler.waiting) != 1 and time.time() < deadline:
                time.sleep(0.02)
            assert len(s.engine.scheduler.waiting) == 1               # one running, one waiting
            r = httpx.post(s.url + "/v1/completions", json={"prompt": PROMPTS, "max_tokens": 2}, timeout=30)
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"     # 1 + 3 > 3
        wait_idle(s.engine)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": PROMPTS, "n": 2, "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and len(r.json()["choices"]) == 6     # larger than the queue: goes when empty
    finally:
        stop_server(s)
