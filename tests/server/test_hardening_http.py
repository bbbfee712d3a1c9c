"""No input makes the server answer 500 or hang; metering is one log line per request; the
drain cancels what outlives the grace period, each request ending once; top logprobs."""
import asyncio
import copy
import json
import logging
import random
import re
import time

import httpx
import pytest

from .conftest import start_server, stop_server

openai = pytest.importorskip("openai")
AUTH = {"Authorization": "Bearer sekret"}
JSON = {"Content-Type": "application/json"}


# -- hostile shapes, as JSON text (NaN, 100k-deep nesting and 5000-digit ints cannot be built by json.dumps)
SHAPES = {
    "objects_100k_deep": '{"a":' * 100_000 + "1" + "}" * 100_000, "arrays_5k_deep": "[" * 5000 + "]" * 5000,
    "arrays_60_deep": "[" * 60 + "]" * 60, "int_5000_digits": "9" * 5000, "int_4000_digits": "-" + "9" * 4000,
    "float_overflow": "1e400", "nan": "NaN", "infinity": "Infinity", "minus_infinity": "-Infinity",
    "null": "null", "empty_string": '""', "huge_string": json.dumps("Once " * 20_000),
    "lone_surrogate": '"\\ud800"', "surrogate_in_list": '["x", "a\\udfff"]', "surrogate_key": '{"\\udbff": 1}',
    "negative": "-1", "zero": "0", "fraction": "1.5", "true": "true", "false": "false", "word": '"no"',
    "object": "{}", "list": "[]", "ints": "[1, 2]",
}
MARK = "@@shape@@"
# every field the parser reads (test_the_fuzzed_fields_are_all_the_parser_reads keeps this true); nested ones
# are set inside a body that is otherwise valid
COMMON = ["model", "echo", "best_of", "suffix", "tools", "user", "chat_template", "max_tokens", "n", "stop",
          "logit_bias", "logprobs", "stream", "stream_options", "stream_options.include_usage", "timeout",
          "first_token_timeout", "on_disconnect", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
          "presence_penalty", "frequency_penalty", "seed", "stop_token_ids", "ignore_eos", "min_tokens",
          "skip_special_tokens", "include_stop_str_in_output", "response_format", "response_format.type",
          "response_format.json_schema", "response_format.json_schema.schema", "structured_outputs",
          "structured_outputs.json", "structured_outputs.regex", "structured_outputs.choice",
          "structured_outputs.grammar", "structured_outputs.json_object", "prompt_logprobs"]
FIELDS = {"/v1/completions": ["prompt"] + COMMON,
          "/v1/chat/completions": ["messages", "messages[0]", "messages[0].role", "messages[0].content",
                                   "max_completion_tokens", "top_logprobs", "prediction", "prediction.type",
                                   "prediction.content", "tool_choice", "parallel_tool_calls", "functions",
                                   "function_call", "add_generation_prompt", "continue_final_message"] + COMMON}
# a chat template that concatenates, as many real ones do: content null is a TypeError inside it
CONCAT = ("{% for m in messages %}{{ bos_token + m['role'] + ': ' + m['content'] }}{% endfor %}"
          "{% if add_generation_prompt %} Answer:{% endif %}")


HOLDERS = {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}, "stream_options": {},
           "structured_outputs": {}, "prediction": {"type": "content", "content": "Once"}}


def wait_idle(engine, timeout=30):
    end = time.monotonic() + timeout
    while engine.has_unfinished() and time.monotonic() < end:
        time.sleep(0.02)
    assert not engine.has_unfinished()


def fuzz_body(path, field, shape):
    """A valid max_tokens-1 request with `field` (a dotted / indexed path) holding the shape's text."""
    body = {"prompt": "Once"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Once"}]}
    body["max_tokens"] = 1
    keys = [int(k) if k.isdigit() else k for k in re.findall(r"[^.\[\]]+", field)]
    if len(keys) > 1 and keys[0] in HOLDERS:
        body[keys[0]] = copy.deepcopy(HOLDERS[keys[0]])
    where = body
    for k in keys[:-1]:
        where = where[k]
    where[keys[-1]] = MARK
    return json.dumps(body).replace(json.dumps(MARK), shape)


def names(param, field):
    """param names the field, a part of it, or (for a nested field) the object holding it."""
    if param is None:
        return False
    return any(a == b or a.startswith(b + ".") or a.startswith(b + "[") for a, b in ((param, field), (field, param)))


@pytest.fixture(scope="module")
def strict_server(stories_path):
    s = start_server(stories_path, template=CONCAT)
    yield s
    stop_server(s)


def test_every_field_with_every_hostile_shape(strict_server):
    s = strict_server
    with httpx.Client(timeout=60, headers=JSON) as c:
        for path, fields in FIELDS.items():
            for field in fields:
                for shape_name, shape in SHAPES.items():
                    r = c.post(s.url + path, content=fuzz_body(path, field, shape))
                    what = (path, field, shape_name, r.status_code, r.text[:300])
                    assert r.status_code < 500, what
                    if r.status_code >= 400:
                        err = r.json()["error"]
                        assert set(err) == {"message", "type", "param", "code"}, what
                        assert names(err["param"], field), what
                    else:
                        assert r.text.startswith("id:") or r.json()["choices"], what      # SSE or a body
    wait_idle(s.engine)
    s.engine.check_integrity()
    sch = s.engine.scheduler
    assert sch.pool.free_pages == sch.pool.num_pages and sch.slots.free_slots == sch.slots.num_slots
    r = httpx.post(s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Once"}],
                                                          "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


class Reading(dict):
    """A body that remembers which of its fields (dotted paths) were read."""

    def __init__(self, data, seen, prefix=""):
        super().__init__({k: Reading(v, seen, f"{prefix}{k}.") if isinstance(v, dict) else
                          [Reading(x, seen, f"{prefix}{k}[{i}].") if isinstance(x, dict) else x
                           for i, x in enumerate(v)] if isinstance(v, list) else v for k, v in data.items()})
        self.seen, self.prefix = seen, prefix

    def _saw(self, k):
        self.seen.add(self.prefix + k)

    def get(self, k, default=None):
        self._saw(k)
        return super().get(k, default)

    def __getitem__(self, k):
        self._saw(k)
        return super().__getitem__(k)

    def __contains__(self, k):
        self._saw(k)
        return super().__contains__(k)


def test_the_fuzzed_fields_are_all_the_parser_reads():
    from pagedecode.server.protocol import ApiError, Limits, parse_request
    for path, fields in FIELDS.items():
        seen = set()
        for field in fields:
            for shape in ('"x"', "true", "1", "{}", "[]"):
                try:
                    body = json.loads(fuzz_body(path, field, shape))
                    parse_request(Reading(body, seen), path.endswith("chat/completions"), {}, Limits())
                except ApiError:
                    pass
        seen = {re.sub(r"\[\d+\]", "[0]", f) for f in seen} | {"model"}      # the app reads model
        assert seen <= set(fields), seen - set(fields)


NO_500 = [
    ("/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "prompt"),
    ("/v1/completions", b'{"prompt": "x", "stop": ' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_000 + b"}", "stop"),
    ("/v1/completions", b'{"prompt": "x", "logit_bias": ' + b"[" * 5000 + b"]" * 5000 + b"}", "logit_bias"),
    ("/v1/completions", b'{"prompt": "x", "seed": ' + b"9" * 4301 + b"}", "seed"),
    ("/v1/completions", b'{"prompt": [1, -' + b"9" * 5000 + b"]}", "prompt[1]"),
    ("/v1/completions", b'{"seed": ' + b"9" * 5000 + b', "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
     "prompt"),                                 # the second parse, which finds the long int, meets the depth
    ("/v1/completions", b'{"seed": ' + b"9" * 5000 + b', "prompt": "x}', None),
    ("/v1/completions", b'{"prompt": "x", "timeout": 1' + b"0" * 400 + b"}", "timeout"),      # float() overflows
    ("/v1/completions", rb'{"prompt": "\ud800"}', "prompt"),
    ("/v1/completions", rb'{"prompt": "x", "stop": ["a", "b\udc00"]}', "stop[1]"),
    ("/v1/completions", rb'{"prompt": "x", "user": "\udbff\udbff"}', "user"),
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "\ud800"}]}', "messages[0].content"),
    ("/v1/chat/completions", rb'{"messages": [{"role": "\udfff", "content": "x"}]}', "messages[0].role"),
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}',
     "messages[0].content[0].text"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": null}]}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}]}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}',
     "max_completion_tokens"),
    ("/v1/completions", b'{"prompt": "x", "stream": true, "stream_options": {"include_usage": "no"}}',
     "stream_options.include_usage"),
    ("/v1/completions", b'{"prompt": "x", "echo": 0}', "echo"),
    ("/v1/completions", b'{"prompt": "x", "ignore_eos": "no"}', "ignore_eos"),
    ("/v1/completions", b'{"prompt": "x", "min_tokens": false}', "min_tokens"),
    ("/v1/completions", b'{"prompt": "x", "stop_token_ids": 0}', "stop_token_ids"),
    ("/v1/completions", b'{"prompt": "x", "skip_special_tokens": 1}', "skip_special_tokens"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "logprobs": 1}', "logprobs"),
    ("/v1/completions", b'{"prompt": "x", "structured_outputs": {"json_object": "yes"}}',
     "structured_outputs.json_object"),
    ("/v1/completions", b'{"prompt": "x", "structured_outputs": {"json": "' + b"[" * 100_000 + b'"}}',
     "structured_outputs.json"),
    ("/v1/completions", b'{"prompt": "x", "logit_bias": {"99999": 1}}', "logit_bias"),
    ("/v1/completions", b'{"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": false}}}',
     "response_format"),
]


@pytest.mark.parametrize("path, raw, param", NO_500, ids=[f"{param}-{i}" for i, (_, _, param) in enumerate(NO_500)])
def test_no_input_answers_500(strict_server, path, raw, param):
    r = httpx.post(strict_server.url + path, content=raw, headers=JSON, timeout=60)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"], err


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/v1/nothing", 404), ("POST", "/", 404), ("GET", "/v1/completions", 405),
    ("OPTIONS", "/v1/chat/completions", 405), ("DELETE", "/v1/models", 405)])
def test_unknown_routes_and_methods_answer_openai_errors(strict_server, method, path, status):
    r = httpx.request(method, strict_server.url + path, headers=JSON)
    assert r.status_code == status
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    if status == 405:
        assert r.headers["allow"]                  # what is allowed there, as Starlette says


@pytest.mark.parametrize("authorization, status", [
    ("bearer sekret", 200), ("BEARER sekret", 200), ("Bearer   sekret", 200), ("Bearer sekret", 200),
    ("Basic sekret", 401), ("Bearersekret", 401), ("bearer wrong", 401), ("sekret", 401)])
def test_the_bearer_scheme_is_case_insensitive(server, authorization, status):
    r = httpx.post(server.url + "/v1/completions", headers={"Authorization": authorization},
                   json={"prompt": "Once", "max_tokens": 1})
    assert r.status_code == status
    if status == 401:
        assert r.json()["error"]["code"] == "invalid_api_key"


def random_value(rng, depth=0):
    kinds = ["int", "float", "str", "bool", "none", "list", "dict", "big", "neg"]
    k = rng.choice(kinds if depth < 2 else kinds[:5])
    return {"int": lambda: rng.randint(-5, 50), "float": lambda: rng.uniform(-3, 3), "str": lambda: rng.choice(["", "x", "é" * 40, "\x00"]),
            "bool": lambda: rng.random() < 0.5, "none": lambda: None,
            "list": lambda: [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))],
            "dict": lambda: {rng.choice(["a", "1", "role", "content"]): random_value(rng, depth + 1)},
            "big": lambda: 10 ** rng.randint(10, 400), "neg": lambda: -(10 ** rng.randint(1, 30))}[k]()


def test_random_bodies_never_500(server):
    rng = random.Random(1)
    top = sorted({f.split(".")[0].split("[")[0] for fs in FIELDS.values() for f in fs})
    with httpx.Client(timeout=30, headers={**AUTH, "Content-Type": "application/json"}) as c:
        for i in range(150):
            body = {f: random_value(rng) for f in rng.sample(top, rng.randint(1, 8))}
            if rng.random() < 0.5:
                body["prompt"] = "Once"
            if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
                body["max_tokens"] = 8
            path = "/v1/chat/completions" if i % 3 == 0 else "/v1/completions"
            text = json.dumps(body)
            if rng.random() < 0.3:            # one value becomes a hostile shape
                text = text.replace("null", rng.choice(list(SHAPES.values())), 1)
            r = c.post(server.url + path, content=text)
            assert r.status_code < 500, (text[:300], r.text)
            if r.status_code != 200:
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    wait_idle(server.engine)
    server.engine.check_integrity()


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


def test_an_over_long_prompt_names_its_field(server):
    long = "Once upon a time " * 200                       # > 512 tokens, stories260k's context
    r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH,
                   json={"messages": [{"role": "user", "content": long}], "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "context" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", headers=AUTH, json={"prompt": long, "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


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
