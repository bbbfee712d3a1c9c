"""A request body as JSON that the rest of the server can walk without surprises, or a 400
naming the field that is not: nested deeper than MAX_DEPTH (json.loads itself raises
RecursionError near 1000 levels, and whatever walks the body later would too), an integer
longer than Python converts (sys.get_int_max_str_digits(), 4300 digits), a string holding a
lone surrogate ("\\ud800" is valid JSON but no valid Unicode: encoding it fails later).
"""
from __future__ import annotations

import json
import re
from typing import Any

from ..params import unicode_error
from .errors import ApiError

MAX_DEPTH = 64          # levels of arrays and objects; a chat body needs 4, a JSON schema rarely 20

# the tokens that open, close and name things: strings (keys among them), brackets, colons
_TOKENS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}:]')


class _HugeInt:
    """An integer literal too long to convert, kept so that the walk can name its field."""

    def __init__(self, digits: str) -> None:
        self.digits = len(digits.lstrip("-"))


def _int_or_huge(s: str) -> int | _HugeInt:
    try:
        return int(s)
    except ValueError:
        return _HugeInt(s)


def load(raw: bytes | str, field: str = "") -> Any:
    """The request body (or, named by `field`, a JSON text inside it) parsed and checked."""
    try:
        try:
            body = json.loads(raw)
        except ValueError as e:
            if isinstance(e, (json.JSONDecodeError, UnicodeDecodeError)):
                raise
            body = json.loads(raw, parse_int=_int_or_huge)   # an integer over the conversion limit: find where
    except RecursionError:
        raise _too_deep(field or _deep_field(raw.encode() if isinstance(raw, str) else raw)) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        if field:
            raise _field(field, f"malformed JSON: {e}") from None
        raise ApiError(400, f"malformed JSON: {e}", code="invalid_json") from None
    check(body, field)
    return body


def check(body: Any, field: str = "") -> None:
    """Walk the parsed body (without recursion) and refuse the first value no field could take."""
    stack: list[tuple[Any, str, int, str]] = [(body, field, 0, field)]    # value, path, depth, top-level key
    while stack:
        value, path, depth, top = stack.pop()
        if isinstance(value, str):
            why = unicode_error(value)
            if why is not None:
                raise _field(path, f"the string {why}")
        elif isinstance(value, _HugeInt):
            raise _field(path, f"an integer of {value.digits} digits is out of range")
        elif isinstance(value, list):
            if depth >= MAX_DEPTH:
                raise _too_deep(top)
            stack.extend((v, f"{path}[{i}]", depth + 1, top) for i, v in enumerate(value)
                         if not isinstance(v, (int, float)))          # numbers need no look (token ids)
        elif isinstance(value, dict):
            if depth >= MAX_DEPTH:
                raise _too_deep(top)
            for k, v in value.items():
                where = f"{path}.{k}" if path else k
                why = unicode_error(k)
                if why is not None:
                    raise _field(where, f"the key {why}")
                stack.append((v, where, depth + 1, top or k))


def _field(path: str, message: str) -> ApiError:
    if not path:
        return ApiError(400, f"the request body: {message}", code="invalid_value")
    return ApiError(400, f"{path}: {message}", param=path, code="invalid_value")


def _too_deep(field: str | None) -> ApiError:
    return _field(field or "", f"nested deeper than {MAX_DEPTH} levels")


def _deep_field(raw: bytes) -> str | None:
    """The top-level key under which `raw` nests deeper than MAX_DEPTH (found without parsing it
    whole, which is what failed)."""
    depth, key, last = 0, None, b""
    for m in _TOKENS.finditer(raw):
        t = m.group()
        if t in (b"[", b"{"):
            depth += 1
            if depth > MAX_DEPTH:
                try:
                    name = json.loads(key) if key is not None else None
                except ValueError:
                    return None
                return name if isinstance(name, str) else None
        elif t in (b"]", b"}"):
            depth -= 1
        elif t == b":":
            if depth == 1:
                key = last
        else:
            last = t
    return None
