"""Every entry of the request-field table (server/protocol.py FIELDS, and the Responses API's
own fields) refuses a value of the wrong type and a value out of range with a 400 that names
the field as the client spelled it (or the part of it in error), on each endpoint that reads it. The table may grow: a field
without cases here fails test_every_table_field_has_cases."""
import httpx
import pytest

from pagedecode.server.protocol import FIELDS
from pagedecode.server.responses_input import PASSED

from .conftest import start_server, stop_server

NINE_STOPS = [f"s{i}" for i in range(9)]            # Limits.max_stops is 8
# field -> (a value of the wrong type, a value of the right type out of range); None: no such value
COMMON = {
    "echo": ("yes", None), "prompt_logprobs": ("x", 21), "best_of": ("x", 2), "suffix": (5, "tail"),
    "tools": (5, [{"type": "function"}]), "user": (5, None), "max_tokens": ("x", 5000), "n": ("x", 17),
    "stop": (5, NINE_STOPS), "logit_bias": ([1], {"1": 101}), "stream_options": ("x", None), "stream": ("yes", None),
    "timeout": ("x", -1), "first_token_timeout": ("x", 0), "on_disconnect": (5, "later"),
    "temperature": ("hot", -1), "top_p": ("x", 2), "top_k": ("x", -2), "min_p": ("x", 1.5),
    "repetition_penalty": ("x", 0), "presence_penalty": ("x", 3), "frequency_penalty": ("x", -3),
    "seed": ("x", -1), "stop_token_ids": ("x", [-1]), "ignore_eos": ("no", None), "min_tokens": ("x", -1),
    "skip_special_tokens": (1, None), "include_stop_str_in_output": ("no", None),
}
CASES = {
    "/v1/completions": {**COMMON, "prompt": (5, [[1]] * 65), "logprobs": ("x", 6)},
    "/v1/chat/completions": {**COMMON, "echo": ("yes", True), "messages": ("x", []),
                             "max_completion_tokens": ("x", 0), "logprobs": (1, None), "top_logprobs": ("x", 21),
                             "prediction": ("x", {"type": "content", "content": 5}),
                             # true beside add_generation_prompt's default (true): the two conflict
                             "add_generation_prompt": ("x", None), "continue_final_message": ("x", True)},
    "/v1/responses": {
        **{name: COMMON[name] for name in ("temperature", "top_p", *PASSED)},
        "input": (5, []), "instructions": (5, None), "max_output_tokens": ("x", 5000), "stream": ("yes", None),
        "store": ("yes", None), "background": ("yes", None), "metadata": (5, {f"k{i}": "v" for i in range(17)}),
        "text": (5, {"format": {"type": "xml"}}), "tool_choice": (5, "required"), "truncation": (5, "never"),
    },
}
BASE = {"/v1/completions": {"prompt": "Once", "max_tokens": 2},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "Once"}], "max_tokens": 2},
        "/v1/responses": {"input": "Once", "max_output_tokens": 2}}
ENDPOINT = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


def values(path, field):
    wrong, out_of_range = CASES[path][field]
    return [("wrong type", wrong)] + ([("out of range", out_of_range)] if out_of_range is not None else [])


def names(param, field):
    """param is the field, or a part of it (text.format of text)."""
    return param is not None and (param == field or param.startswith((field + ".", field + "[")))


@pytest.fixture(scope="module")
def server(stories_path):
    s = start_server(stories_path)
    yield s
    stop_server(s)


def test_every_table_field_has_cases():
    for path, endpoint in ENDPOINT.items():
        read = {f.name for f in FIELDS if endpoint in f.on}
        assert read <= set(CASES[path]), (path, read - set(CASES[path]))
    assert set(PASSED) <= set(CASES["/v1/responses"])


@pytest.mark.parametrize("path", list(CASES))
def test_each_field_refuses_a_wrong_type_and_an_out_of_range_value_naming_itself(server, path):
    failed = []
    with httpx.Client(timeout=30) as c:
        for field in CASES[path]:
            for what, value in values(path, field):
                body = {**BASE[path], field: value}
                r = c.post(server.url + path, json=body)
                err = r.json().get("error") if r.status_code == 400 else None
                if err is None or not names(err["param"], field) or set(err) != {"message", "type", "param", "code"}:
                    failed.append((field, what, value, r.status_code, r.text[:200]))
    assert not failed, "\n".join(map(str, failed))
    assert not server.engine.has_unfinished()
