"""StructuredOutput: a constraint on what a request may generate (JSON schema, regex, EBNF,
choice, any JSON object, an xgrammar structural tag), enforced by xgrammar (the
`pagedecode[structured]` extra). A structural tag is how tool calls are constrained
(pagedecode/tools/constraint.py): free text until a trigger, then a call's schema.

Checks that need nothing else (exactly one constraint, types, schema keywords xgrammar cannot
enforce) are made on construction; the grammar itself is parsed at `add_request`, compiled off
the step loop. Both raise InvalidRequestError naming the problem.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from .errors import InvalidRequestError

# JSON-schema keywords the grammar enforces (or that only annotate); anything else is refused,
# never silently dropped
SCHEMA_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
    "enum", "const", "anyOf", "oneOf", "$ref", "$defs", "definitions", "minLength", "maxLength", "pattern",
    "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "patternProperties",
    "minProperties", "maxProperties", "title", "description", "default", "examples", "$schema", "$id",
    "$comment", "deprecated", "readOnly", "writeOnly"})
FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "uuid", "ipv4", "ipv6", "hostname",
                     "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
MAP_KEYWORDS = ("properties", "$defs", "definitions", "patternProperties")
LIST_KEYWORDS = ("anyOf", "oneOf", "prefixItems")


def _bad(msg: str) -> InvalidRequestError:
    return InvalidRequestError(f"invalid SamplingParams.structured_output: {msg}")


def nesting_depth(value: Any) -> int:
    """How deeply JSON objects and arrays nest in value (a scalar is 0, {} is 1); iterative, so a
    hostile document cannot exhaust the interpreter's stack."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, depth = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((c, depth + 1) for c in children)
    return deepest


def check_schema(schema: Any) -> None:
    """Refuse keywords the grammar cannot enforce (it would accept output that breaks them).
    Iterative (a deep schema is refused by its depth limit, never by a RecursionError)."""
    stack: list[tuple[Any, str]] = [(schema, "#")]
    while stack:
        sch, where = stack.pop()
        if isinstance(sch, bool):
            continue
        if not isinstance(sch, dict):
            raise _bad(f"schema at {where} must be an object or a boolean, got {type(sch).__name__}")
        for key, value in sch.items():
            if key not in SCHEMA_KEYWORDS:
                raise _bad(f"JSON-schema keyword {key!r} at {where} is not supported (it cannot be enforced)")
            if key == "format" and value not in FORMATS:
                raise _bad(f"JSON-schema format {value!r} at {where} is not supported")
            if key in MAP_KEYWORDS:
                if not isinstance(value, dict):
                    raise _bad(f"{key} at {where} must be an object")
                stack.extend((sub, f"{where}/{key}/{name}") for name, sub in value.items())
            elif key in LIST_KEYWORDS:
                if not isinstance(value, list) or not value:
                    raise _bad(f"{key} at {where} must be a non-empty list")
                stack.extend((sub, f"{where}/{key}/{i}") for i, sub in enumerate(value))
            elif key in ("items", "additionalProperties") and not isinstance(value, bool):
                stack.append((value, f"{where}/{key}"))


def _check_structural_tag(tag: Any) -> int:
    """Check a structural tag's JSON schemas as a json_schema constraint's (keywords the grammar
    cannot enforce are refused); its depth is its deepest schema's, the grammar's cost (the
    tag's own nesting is a few fixed levels). Iterative, like check_schema."""
    if not isinstance(tag, dict) or tag.get("type") != "structural_tag" or not isinstance(tag.get("format"), dict):
        raise _bad('structural_tag must be an object {"type": "structural_tag", "format": {...}}')
    deepest, stack = 0, [tag["format"]]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if node.get("type") == "json_schema" and "json_schema" in node:
                check_schema(node["json_schema"])
                deepest = max(deepest, nesting_depth(node["json_schema"]))
            else:
                stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
    return deepest


@dataclass(frozen=True)
class StructuredOutput:
    json_schema: dict[str, Any] | str | None = None   # a JSON schema (object or its JSON text)
    regex: str | None = None
    ebnf: str | None = None                           # a GBNF/EBNF grammar with a `root` rule
    choice: tuple[str, ...] | list[str] | None = None  # the output is exactly one of these
    json_object: bool = False                         # any JSON object
    structural_tag: dict[str, Any] | None = None      # xgrammar's {"type": "structural_tag", "format": ...}
    # None: a constraint max_tokens cuts is cut (finish "length"). Tool calls (tools/constraint.py):
    # once the output holds one of these texts (empty: from the first token), the grammar is
    # finished within max_tokens and the context (runtime/grammar_close.py)
    close_after: tuple[str, ...] | None = None
    kind: str = field(init=False, repr=False, compare=False)  # which one of the six is given
    depth: int = field(init=False, repr=False, compare=False)  # JSON nesting depth (json_schema; else 0)

    def __post_init__(self) -> None:
        given = [n for n in ("json_schema", "regex", "ebnf", "choice", "structural_tag") if getattr(self, n) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise _bad(f"set exactly one of json_schema, regex, ebnf, choice, json_object, structural_tag "
                       f"(got {given or 'none'})")
        kind = given[0]
        if kind == "json_schema":
            schema = self.json_schema
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise _bad(f"json_schema is not valid JSON: {e}") from None
                except RecursionError:
                    raise _bad("json_schema nests too deeply to be read") from None
            object.__setattr__(self, "depth", nesting_depth(schema))
            check_schema(schema)
            object.__setattr__(self, "json_schema", schema)
        elif kind in ("regex", "ebnf"):
            value = getattr(self, kind)
            if not isinstance(value, str) or not value:
                raise _bad(f"{kind} must be a non-empty string")
        elif kind == "choice":
            choices = self.choice
            if (not isinstance(choices, (list, tuple)) or not choices
                    or not all(isinstance(c, str) and c for c in choices)):
                raise _bad("choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(choices))
        elif kind == "structural_tag":
            object.__setattr__(self, "depth", _check_structural_tag(self.structural_tag))
        elif self.json_object is not True:
            raise _bad("json_object must be a bool")
        if self.close_after is not None:
            if not isinstance(self.close_after, (list, tuple)) or not all(
                    isinstance(a, str) and a for a in self.close_after):
                raise _bad("close_after must be a list of non-empty strings")
            object.__setattr__(self, "close_after", tuple(self.close_after))
        object.__setattr__(self, "kind", kind)
        if kind not in ("json_schema", "structural_tag"):
            object.__setattr__(self, "depth", 0)

    @cached_property
    def _canonical(self) -> tuple[str, int]:
        """(digest, size) of the canonical form. A JSON schema is serialised here, not at
        construction: the engine checks its depth first (the encoder recurses)."""
        if self.kind in ("json_schema", "structural_tag"):
            try:
                text = json.dumps(getattr(self, self.kind), sort_keys=True)
            except RecursionError:
                raise _bad("json_schema nests too deeply to be serialised") from None
        elif self.kind == "choice":
            text = json.dumps(list(self.choice or ()))
        else:
            text = getattr(self, self.kind) if self.kind != "json_object" else ""
        data = text.encode()
        return hashlib.sha256(data).hexdigest(), len(data)

    @property
    def key(self) -> str:
        """kind:digest of the canonical form, for the compile cache (a digest, not the text: the
        cache keeps its keys, and a schema can be megabytes)."""
        return f"{self.kind}:{self._canonical[0]}"

    @property
    def size(self) -> int:
        """Bytes of the constraint as given to the grammar: the schema's JSON, the regex or EBNF
        text, the choices as a JSON list."""
        return self._canonical[1]
