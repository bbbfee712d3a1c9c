"""The way to finish a grammar (runtime/grammar_close.py Closer.way), on the built-in model's
byte-level vocabulary: from the start of a JSON schema and from inside its values, the way's text
completes a document that validates; it escapes a pattern's loop (`[a-z0-9.]+@...`, where `0`
could repeat forever); it ends with a stop token only where the grammar could go on; it honours
its limit; the matcher is left as it was found."""
import json

import pytest

import pagedecode as pd
from pagedecode.runtime.grammar_close import Closer

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

EMAIL = {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9.]+$"}
SCHEMAS = [
    {"type": "object", "properties": {"to": EMAIL, "subject": {"type": "string", "maxLength": 60},
                                      "body": {"type": "string", "maxLength": 200}},
     "required": ["to", "subject", "body"], "additionalProperties": False},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 480},
                                      "x": {"type": "number", "minimum": 0},
                                      "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
     "required": ["n", "x", "date"], "additionalProperties": False},
    {"type": "object", "properties": {
        "items": {"type": "array", "minItems": 2, "items": {
            "type": "object", "properties": {"name": {"type": "string", "minLength": 3}, "ok": {"type": "boolean"},
                                             "kind": {"enum": ["alpha", "beta"]}},
            "required": ["name", "ok", "kind"], "additionalProperties": False}},
        "note": {"type": "string"}}, "required": ["items"], "additionalProperties": False},
    {"type": "object", "properties": {"sym": {"type": "string", "pattern": "^[A-Z]{1,5}$"}, "none": {"type": "null"},
                                      "c": {"const": 'say "hi" {}'}},
     "required": ["sym", "none", "c"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def compiler():
    from pagedecode.model.default_model import default_model_path
    engine = pd.Engine.from_pretrained(default_model_path())
    c = engine.constraints.compiler
    c.warm().result()
    return c, Closer(c.token_bytes, c.stop_ids, engine.vocab_size)


def matcher(compiler, so):
    c, _ = compiler
    return c.matcher(c.submit(so).compiled.result())


def text(closer, tokens):
    return b"".join(closer.token_bytes[t] for t in tokens).decode()


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
@pytest.mark.parametrize("prefix", ["", '{"', "inside"])
def test_the_way_completes_a_valid_document(compiler, i, prefix):
    schema = SCHEMAS[i]
    _, closer = compiler
    m = matcher(compiler, pd.StructuredOutput(json_schema=schema))
    if prefix == "inside":                      # inside the first property's value, whatever it is
        prefix = '{"' + next(iter(schema["properties"])) + '": '
        prefix += {0: '"bob.smith', 1: "1", 2: '[{"name": "x', 3: '"A'}[i]
    assert m.accept_string(prefix)
    before = m.find_jump_forward_string()
    way = closer.way(m, 500)
    assert way is not None
    assert m.find_jump_forward_string() == before              # left as found
    assert way[-1] not in closer.stop_ids                      # a JSON document must end where it closes
    jsonschema.validate(json.loads(prefix + text(closer, way)), schema)
    for t in way:                                             # and the tokens are the grammar's own
        assert m.accept_token(t)
    assert closer._only_stops(m)


def test_a_way_ends_with_a_stop_token_where_the_grammar_could_go_on(compiler):
    _, closer = compiler
    m = matcher(compiler, pd.StructuredOutput(regex="a(b|bc)"))
    assert m.accept_string("a")
    way = closer.way(m, 10)
    assert text(closer, way[:-1]) == "b" and way[-1] in closer.stop_ids     # "b" may go on to "bc"
    assert closer.way(m, 1) is None                                         # two tokens do not fit in one
    assert m.accept_string("b")
    assert closer.way(m, 1) == [way[-1]]


def test_a_patterns_loop_is_escaped(compiler):
    _, closer = compiler
    m = matcher(compiler, pd.StructuredOutput(regex="[a-z0-9.]+@[a-z0-9.]+"))
    assert m.accept_string("work.org")
    way = closer.way(m, 64)
    assert way is not None and "@" in text(closer, way)
