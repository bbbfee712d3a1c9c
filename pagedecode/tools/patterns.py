"""The headers around tool calls as small patterns matched against held-back text: literals,
optional whitespace, a JSON string (a call's name), and the `{` that opens a call's arguments
(or the `"` that opens a generic reply). A pattern answers, for the text so far, whether it
is a complete match, could still become one, or never will: the stream parser holds text back
exactly while some pattern could still match it."""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import NamedTuple

from .formats import ToolFormat

MAX_NAME_CHARS = 256            # a longer name ends the match: held text stays bounded
WHITESPACE = " \t\r\n"


class Item(enum.Enum):
    WS = "whitespace"           # zero or more whitespace characters
    NAME = "name"               # a JSON string: the call's name
    ARGS = "{"                  # the arguments object's `{` (the last item: it belongs to the arguments)
    REPLY = '"'                 # the generic reply's opening quote (the last item)


Piece = str | Item


class Match(enum.Enum):
    NO = "no"                   # never, whatever follows
    MAYBE = "maybe"             # a prefix of a match
    YES = "yes"                 # complete: the last character is its final item's


class Matched(NamedTuple):
    state: Match
    name: str | None = None


@dataclass(frozen=True)
class Pattern:
    kind: str                   # "call": a call begins; "reply": a generic reply begins; "end": a section ends
    pieces: tuple[Piece, ...]

    def match(self, text: str) -> Matched:
        i, name = 0, None
        for piece in self.pieces:
            if piece is Item.WS:
                while i < len(text) and text[i] in WHITESPACE:
                    i += 1
                if i == len(text):
                    return Matched(Match.MAYBE)
            elif isinstance(piece, str):
                got = text[i:i + len(piece)]
                if not piece.startswith(got):
                    return Matched(Match.NO)
                if len(got) < len(piece):
                    return Matched(Match.MAYBE)
                i += len(piece)
            elif piece is Item.NAME:
                end = _string_end(text, i)
                if end is None:
                    return Matched(Match.NO)
                if end == len(text):
                    return Matched(Match.MAYBE)
                try:
                    name = json.loads(text[i:end])
                except ValueError:
                    return Matched(Match.NO)
                i = end
            else:                                  # ARGS / REPLY: the final character
                if i == len(text):
                    return Matched(Match.MAYBE)
                if text[i] != piece.value or i + 1 != len(text):
                    return Matched(Match.NO)
                return Matched(Match.YES, name)
        if i == len(text):                         # a pattern ending in a literal ("end")
            return Matched(Match.YES, name)
        return Matched(Match.NO)


def _string_end(text: str, i: int) -> int | None:
    """The index after the JSON string at text[i] (len(text) while it is still open); None when
    text[i] opens no string or it runs past MAX_NAME_CHARS."""
    if i == len(text):
        return len(text)
    if text[i] != '"':
        return None
    j, escaped = i + 1, False
    while j < len(text):
        if j - i > MAX_NAME_CHARS:
            return None
        c = text[j]
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif c == '"':
            return j + 1
        j += 1
    return len(text)


def literal(text: str) -> tuple[Piece, ...]:
    """A fixed text whose whitespace may be any whitespace (or none): `<tool_call>\\n` also
    matches `<tool_call>` and `<tool_call>\\n\\n`; `; ` matches `;` and `;\\n`."""
    pieces: list[Piece] = []
    for word in text.split():
        pieces += [Item.WS, word]
    if not pieces:
        pieces = [Item.WS]                         # all whitespace
    elif not text[:1].isspace():
        pieces.pop(0)                              # no whitespace before the first word
    if text[-1:].isspace() and pieces[-1] is not Item.WS:
        pieces.append(Item.WS)
    return tuple(pieces) if text else ()


def header(fmt: ToolFormat) -> tuple[Piece, ...]:
    """A call's text up to and including its arguments' `{`."""
    # never lead with whitespace: a run of it in content would be held, and read again, at length
    begin = (*literal(fmt.call_begin), Item.WS) if fmt.call_begin else ()
    return (*begin, "{", Item.WS, '"name"', Item.WS, ":", Item.WS, Item.NAME, Item.WS,
            ",", Item.WS, f'"{fmt.args_key}"', Item.WS, ":", Item.WS, Item.ARGS)


def first_call(fmt: ToolFormat) -> list[Pattern]:
    """What may start calls in content (and, generic, a reply)."""
    lead = (Item.WS,) if fmt.envelope else ()         # whitespace before a call elsewhere is content
    section = (*literal(fmt.section_begin), Item.WS) if fmt.section_begin else ()
    out = [Pattern("call", (*lead, *section, *header(fmt)))]
    if fmt.envelope:
        out.append(Pattern("reply", (Item.WS, "{", Item.WS, '"response"', Item.WS, ":", Item.WS, Item.REPLY)))
    return out


def after_call(fmt: ToolFormat) -> list[Pattern]:
    """What may follow a call's arguments: its closing text, then the next call or the section's end."""
    close = (Item.WS, "}", *literal(fmt.call_end))
    out = [Pattern("call", (*close, *literal(fmt.separator), Item.WS, *header(fmt)))]
    if fmt.section_end:
        out.append(Pattern("end", (*close, Item.WS, *literal(fmt.section_end))))
    else:
        out.append(Pattern("end", close))
    return out


REPLY_END = Pattern("end", (Item.WS, "}"))
