"""params.py: SamplingParams checks every field's type and range in one table (FIELD_CHECKS),
on construction and, through check_field, for a caller (the server) that needs one value
checked first; the server's caps (server.protocol.Limits) sit inside those bounds."""
import dataclasses
import math

import pytest

from pagedecode.errors import InvalidFieldError, InvalidRequestError
from pagedecode.params import (FIELD_CHECKS, MAX_LOGPROBS, MAX_STOP_CHARS, MAX_STOPS, SamplingParams, check_field,
                               int_error, real_error)


def test_every_field_has_a_check():
    init = [f.name for f in dataclasses.fields(SamplingParams) if f.init]
    assert set(init) == set(FIELD_CHECKS)


@pytest.mark.parametrize("name", sorted(FIELD_CHECKS))
def test_each_check_refuses_a_wrong_type_naming_its_field(name):
    with pytest.raises(InvalidFieldError) as e:
        check_field(name, object())
    assert e.value.field == name and str(e.value).startswith(f"invalid SamplingParams.{name}: ")
    with pytest.raises(InvalidFieldError) as e:
        SamplingParams(**{name: object()})
    assert e.value.field == name and isinstance(e.value, InvalidRequestError)


@pytest.mark.parametrize("name, value", [
    ("max_tokens", -1), ("temperature", -0.5), ("temperature", math.nan), ("top_k", -1), ("top_p", 0.0),
    ("min_p", 1.5), ("repetition_penalty", 0.0), ("presence_penalty", 2.5), ("frequency_penalty", -2.5),
    ("logit_bias", {1: 2e6}), ("logit_bias", {-1: 0.0}), ("seed", 2**64), ("stop", ["x" * (MAX_STOP_CHARS + 1)]),
    ("stop_token_ids", [[]]), ("min_tokens", -1), ("logprobs", MAX_LOGPROBS + 1), ("prompt_logprobs", -1),
    ("deadline_s", 0), ("first_token_timeout_s", 10**400), ("utf8_errors", "ignore"), ("cache_salt", "\ud800")])
def test_each_check_refuses_a_value_out_of_range(name, value):
    with pytest.raises(InvalidFieldError) as e:
        check_field(name, value)
    assert e.value.field == name


def test_rules_that_join_fields_name_one():
    for kwargs, name in [({"max_tokens": 0}, "max_tokens"), ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
                         ({"stop": ["a"] * 10, "stop_token_ids": [1] * 7}, "stop")]:
        with pytest.raises(InvalidFieldError) as e:
            SamplingParams(**kwargs)
        assert e.value.field == name
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).max_tokens == 0


def test_the_shared_predicates():
    assert int_error(True, 0, 1) and int_error(1.0, 0, 1) and int_error(2, 0, 1) and int_error(1, 0, 1) is None
    assert real_error(10**400, 0, 1) and real_error(math.inf, 0, math.inf) and real_error(0.0, 0.0, 1.0, True)
    assert real_error(1, 0, 1) is None


def test_the_servers_caps_are_within_the_params_bounds():
    from pagedecode.server.protocol import Limits
    caps = Limits()
    assert caps.max_stops <= MAX_STOPS and caps.max_stop_chars <= MAX_STOP_CHARS
    assert caps.max_top_logprobs <= MAX_LOGPROBS
