"""What the detokenizers share: the flush modes, their errors, and two questions about bytes
(is this UTF-8 unfinished; could more bytes still make it valid)."""
from __future__ import annotations

STRICT, REPLACE = "strict", "replace"


class Utf8TailError(ValueError):
    """The output ended inside a UTF-8 character."""


class DetokenizerError(RuntimeError):
    """The tokenizer's decode changed text that was already sent."""


def unfinished(data: bytes) -> bool:
    """Whether data is not valid UTF-8 as it stands (unfinished or invalid)."""
    try:
        data.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def valid_prefix(data: bytes) -> bool:
    """Whether data is valid UTF-8 or a valid start of it (more bytes may still complete it)."""
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError as e:
        return e.reason == "unexpected end of data"      # only ever at the very end
