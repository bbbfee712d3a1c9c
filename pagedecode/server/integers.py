"""Integers written as text by a client (headers, query values, JSON object keys): plain ASCII
decimal only. Python's int() also takes "1_0", "+3", " 3 " and other scripts' digits ("٣"), so
two spellings of one id would pass a check written for one of them."""
from __future__ import annotations

MAX_DIGITS = 19          # an int64's worth: a longer number is not an id or a count we keep


def parse_decimal(text: str) -> int | None:
    """The integer `text` spells as an optional "-" then 1..MAX_DIGITS ASCII digits, else None."""
    digits = text[1:] if text.startswith("-") else text
    if not 0 < len(digits) <= MAX_DIGITS or not digits.isascii() or not digits.isdigit():
        return None
    return int(text)
