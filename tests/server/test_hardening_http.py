"""No input makes the server answer 500 or hang; metering is one log line per request; the
drain cancels what outlives the grace period, each request ending once; top logprobs."""
import asyncio
import json
import logging
import random
import time

import httpx
import pytest

from .conftest import start_server, stop_server

openai = pytest.importorskip("openai")
AUTH = {"Authorization": "Bearer sekret"}


def random_value(rng, depth=0):
    kinds = ["int", "float", "str", "bool", "none", "list", "dict", "big", "neg"]
    k = rng.choice(kinds if depth < 2 else kinds[:5])
    return {"int": lambda: rng.randint(-5, 50), "float": lambda: rng.uniform(-3, 3), "str": lambda: rng.choice(["", "x", "é" * 40, "\x00"]),
            "bool": lambda: rng.random() < 0.5, "none": lambda: None,
            "list": lambda: [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))],
            "dict": lambda: {rng.choice(["a", "1", "role", "content"]): random_value(rng, depth + 1)},
            "big": lambda: 10 ** rng.randint(10, 400), "neg": lambda: -(10 ** rng.randint(1, 30))}[k]()


FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "seed", "stop",
          "stop_token_ids", "ignore_eos", "min_tokens", "logprobs", "top_logprobs", "stream", "stream_options",
          "n", "timeout", "first_token_timeout", "on_disconnect", "user", "model"]


def test_random_bodies_never_500(server):
    rng = random.Random(1)
    with httpx.Client(timeout=30, headers={**AUTH, "Content-Type": "application/json"}) as c:
        for i in range(150):
            body = {f: random_value(rng) for f in rng.sample(FIELDS, rng.randint(1, 8))}
            if rng.random() < 0.5:
                body["prompt"] = "Once"
            if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
                body["max_tokens"] = 8
            path = "/v1/chat/completions" if i % 3 == 0 else "/v1/completions"
            r = c.post(server.url + path, content=json.dumps(body))
            assert r.status_code < 500, (body, r.text)
            if r.status_code != 200:
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    for _ in range(100):
        if not server.engine.has_unfinished():
            break
        asyncio.run(asyncio.sleep(0.05))
    assert not server.engine.has_unfinished()


def test_one_log_line_per_request_without_text(server, caplog):
    with caplog.at_level(logging.INFO, logger="pagedecode.server"):
        r = httpx.post(server.url + "/v1/completions", headers=AUTH, json={"prompt": "Once", "max_tokens": 4})
        rid = r.json()["id"]
        for _ in range(50):
            if any(rid in m for m in caplog.messages):
                break
            asyncio.run(asyncio.sleep(0.02))
    lines = [m for m in caplog.messages if f'"request_id": "{rid}"' in m]
    assert len(lines) == 1
    rec = json.loads(lines[0].split(" ", 1)[1])
    assert rec["returned_tokens"] == 4 and rec["finish_reason"] == "max_output_tokens" and "text" not in rec
    assert {"queue_s", "prefill_s", "decode_s", "retries", "resumes"} <= set(rec)


def test_top_logprobs_with_strings(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="sekret", max_retries=0)
    r = client.chat.completions.create(model="stories260k", messages=[{"role": "user", "content": "Once"}],
                                       max_tokens=3, logprobs=True, top_logprobs=4)
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 4 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[-1].logprob for c in content)
    assert content[0].top_logprobs[0].token == content[0].token                # greedy: the best one
    c = client.completions.create(model="stories260k", prompt="Once upon a time", max_tokens=3, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.top_logprobs) == 3 and all(len(d) <= 2 for d in lp.top_logprobs)
    assert "".join(lp.tokens) == c.choices[0].text and lp.text_offset[0] == 0


def test_request_templates_are_refused(server):
    r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH,
                   json={"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 7 * 7 }}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"


def test_drain_cancels_what_outlives_the_grace(stories_path):
    from pagedecode.server.serve import drain
    s = start_server(stories_path, template=None)
    try:
        real = s.engine.model.forward

        def slow(batch, kv):            # the compiled CPU forward would finish 400 tokens in the grace
            time.sleep(0.005)
            return real(batch, kv)
        s.engine.model.forward = slow
        rids = [s.engine.add_request("Once", __import__("pagedecode").SamplingParams(
            max_tokens=400, ignore_eos=True)) for _ in range(3)]
        fut = asyncio.run_coroutine_threadsafe(drain(s.ae, s.state, 0.2), s.ae._loop)
        fut.result(timeout=30)
        outs = [s.engine.result(r) for r in rids]
        assert all(o.state.value == "cancelled" for o in outs)
        assert all(sum(type(e).__name__ == "TerminalEvent" for e in s.engine.replay(r)) == 1 for r in rids)
        assert httpx.get(s.url + "/health").status_code == 503                  # draining
    finally:
        stop_server(s)


def test_failure_after_the_first_chunk_is_an_error_chunk(stories_path):
    s = start_server(stories_path, template=None)
    try:
        real = s.engine.model.forward
        calls = {"n": 0}

        def flaky(batch, kv):
            calls["n"] += 1
            if calls["n"] == 6:
                raise RuntimeError("device fell over")
            return real(batch, kv)
        s.engine.model.forward = flaky
        with httpx.stream("POST", s.url + "/v1/completions",
                          json={"prompt": "Once", "max_tokens": 30, "stream": True}) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        err = json.loads(lines[-2][6:])
        assert "device fell over" in err["error"]["message"] and err["error"]["code"] == "model_error"
        assert any(json.loads(ln[6:]).get("choices") for ln in lines[:-2])       # content came first
    finally:
        stop_server(s)
