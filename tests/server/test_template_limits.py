"""A hostile chat template (it comes from the model file) cannot take the server's memory or its
time (issue 34, item 3): every render is bounded in time, steps and size inside the sandbox,
and crossing a bound is a 400 naming the chat template; a template that does not parse stops
`serve` with one line."""
import subprocess
import sys
import threading
import time

import httpx
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pagedecode.server.chat import ChatTemplate
from pagedecode.server.errors import ApiError
from pagedecode.server.template_budget import TemplateLimits

from .conftest import TEMPLATE, start_server, stop_server

HI = [{"role": "user", "content": "hi"}]
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
DOUBLING = "{% set ns = namespace(v=VALUE) %}{% for i in range(40) %}{% set ns.v = STEP %}{% endfor %}{{ ns.v }}"
HOSTILE = [
    "{{ 'x' * 10**9 }}", "{{ '%0999999999d' % 1 }}", "{{ messages|tojson(indent=10**8) }}", NESTED_LOOPS,
    "{{ '%*d' % (10**9, 1) }}", "{{ '{:0999999999}'.format(1) }}", "{{ 'x'|center(1000000000) }}",
    "{{ 'x'.ljust(10**9) }}", "{{ (1).to_bytes(10**9, 'big') }}", "{{ lipsum(10**9) }}", "{{ 'x'|indent(10**9) }}",
    "{{ ('a\n' * 1000000)|indent('x' * 1000) }}", "{% set s = 'x' * 1000000 %}{{ s|replace('x', s) }}",
    "{{ ' '.join(['x' * 1000000] * 1000) }}", "{{ (range(100000)|list) * 100000 }}", "{{ 10 ** (10 ** 10) }}",
    "{{ ([range(1000)|list] * 1000)|sum(start=[]) }}", "{% macro f(n) %}{{ f(n) }}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "{% for x in range(2) recursive %}{{ loop(range(2)) }}{% endfor %}",
    *(DOUBLING.replace("VALUE", value).replace("STEP", step) for value, step in [
        ("'x'", "ns.v ~ ns.v"), ("['x']", "[ns.v, ns.v]"), ("['x']", "ns.v + ns.v"), ("2", "ns.v * ns.v"),
        ("{'a': 'x'}", "{'a': ns.v, 'b': ns.v}"), ("'x'", "[ns.v, ns.v]|join"), ("'x'", "'%s%s' % (ns.v, ns.v)"),
        ("'x'", "'{}{}'.format(ns.v, ns.v)"), ("'x'", "ns.v|replace('x', 'xx')"), ("['x']", "dict(a=ns.v, b=ns.v)"),
        ("['x']", "namespace(a=ns.v, b=ns.v)"), ("['x']", "[ns.v, ns.v]|map('string')|list")]),
]


@pytest.mark.parametrize("source", HOSTILE)
def test_a_hostile_template_is_a_400_quickly(source):
    template = ChatTemplate(source, {})
    started = time.monotonic()
    with pytest.raises(ApiError) as refused:
        template.render(HI)
    assert time.monotonic() - started < 3
    error = refused.value.body()["error"]
    assert refused.value.status == 400 and error["code"] == "chat_template_limit"
    assert error["message"].startswith("the chat template exceeded its limits: ")


@pytest.mark.parametrize("limits,source,bound", [
    (TemplateLimits(max_chars=100), "{{ 'x' * 101 }}", "101 characters"),
    (TemplateLimits(max_chars=100), "{{ 'x' * 50 }}{{ 'x' * 51 }}", "the output would be 101"),
    (TemplateLimits(max_steps=10), "{% for i in range(11) %}{% endfor %}", "more than 10 loop steps"),
    (TemplateLimits(time_s=0.05, max_steps=10**9), NESTED_LOOPS, "longer than 0.05s"),
])
def test_the_limits_are_options(limits, source, bound):
    with pytest.raises(ApiError, match=bound):
        ChatTemplate(source, {}, limits).render(HI)


def test_a_render_at_its_limits_passes():
    limits = TemplateLimits(max_chars=101, max_steps=101)
    assert ChatTemplate("{% for i in range(101) %}x{% endfor %}", {}, limits).render(HI) == "x" * 101


SMOL = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
        "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TOOLS = ("{{ bos_token }}{% if tools %}{{ tools|tojson(indent=2) }}{% endif %}{% for m in messages %}"
         "{{ m.role|upper ~ ': ' ~ m.content|trim }}{{ '%s/%d' % (m.role, loop.index) }}{% endfor %}"
         "{{ messages|map(attribute='role')|join(', ') }}{{ '{}-{}'.format(1, 2) }}{{ (messages|length) * 2 }}")


@pytest.mark.parametrize("source", [TEMPLATE, SMOL, TOOLS])
def test_a_real_template_renders_as_plain_jinja_does(source):
    messages = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "Once upon " * 300},
                {"role": "assistant", "content": " a time"}]
    extra = {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    plain.filters["tojson"] = lambda v, indent=None: __import__("json").dumps(v, ensure_ascii=False, indent=indent)
    expected = plain.from_string(source).render(messages=messages, add_generation_prompt=True, bos_token="<s>",
                                                **extra)
    assert ChatTemplate(source, {"bos_token": "<s>"}).render(messages, extra=extra) == expected


@pytest.fixture(scope="module")
def looping(stories_path):
    s = start_server(stories_path, template=NESTED_LOOPS)
    yield s
    stop_server(s)


def test_the_server_answers_400_and_keeps_serving(looping):
    started = time.monotonic()
    r = httpx.post(looping.url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 2}, timeout=20)
    assert r.status_code == 400 and r.json()["error"]["code"] == "chat_template_limit", r.text
    assert "chat template" in r.json()["error"]["message"] and time.monotonic() - started < 3
    assert httpx.get(looping.url + "/health", timeout=5).status_code == 200
    ok = httpx.post(looping.url + "/v1/completions", json={"prompt": "Once", "max_tokens": 2}, timeout=20)
    assert ok.status_code == 200


def test_health_answers_while_a_template_renders(stories_path):
    s = start_server(stories_path, template=NESTED_LOOPS)
    s.state.chat_template.limits = TemplateLimits(time_s=1.5, max_steps=10**12)   # a render of 1.5 s
    try:
        answers = []

        def ask():
            answers.append(httpx.post(s.url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 2},
                                      timeout=20))
        chat = threading.Thread(target=ask)
        chat.start()
        time.sleep(0.2)
        worst = 0.0
        while chat.is_alive():
            t0 = time.monotonic()
            assert httpx.get(s.url + "/health", timeout=5).status_code == 200
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.05)
        assert "longer than 1.5s" in answers[0].json()["error"]["message"]
        assert worst < 0.3
    finally:
        stop_server(s)


def test_a_template_that_does_not_parse_stops_serve_with_one_line(tmp_path, stories_path):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }")
    done = subprocess.run([sys.executable, "-m", "pagedecode.cli", "serve", "--model", str(stories_path), "--port", "0",
                           "--chat-template", str(bad)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("pagedecode serve: the chat template does not parse: ")
