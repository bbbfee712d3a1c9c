"""Tool calls parsed out of generated text, incrementally: fed text deltas in any chunking, a
ToolStreamParser emits content deltas and call deltas (a call's id and name first, then its
arguments as they are generated, then its end). `parse_tool_output` is the same parser fed the
whole text, so a stream's deltas folded together equal the output parsed whole, exactly.

It works a character at a time. In content it holds back text that could still begin a call
(patterns.py); a call's arguments are scanned as JSON (strings, escapes, depth), so a string
holding `}` or `</tool_call>` never ends a call; after a call it holds the closing text and
either the next call or the section's end. Every decision depends on the characters alone,
never on where a chunk ended.
"""
from __future__ import annotations

import enum
import json
from collections import deque
from typing import Callable

from .calls import ContentDelta, Delta, ToolCall, ToolCallDelta, ToolCallEnd, ToolOutput, new_call_id
from .formats import ToolFormat
from .patterns import REPLY_END, Match, Pattern, after_call, first_call


class Mode(enum.Enum):
    CONTENT = "content"        # text outside calls (held back while it may begin one)
    ARGS = "args"              # inside a call's arguments object
    AFTER = "after"            # after a call's arguments: its closing text, the next call or the end
    REPLY = "reply"            # inside the generic format's reply string (decoded to content)
    AFTER_REPLY = "after_reply"   # after the reply string: the envelope's `}`


class ToolStreamParser:
    """One per request. `feed(text)` and `finish()` return the deltas that text made known."""

    def __init__(self, fmt: ToolFormat, new_id: Callable[[], str] = new_call_id) -> None:
        self.fmt = fmt
        self.new_id = new_id
        self.output = ToolOutput()          # everything emitted so far, folded
        self.mode = Mode.CONTENT
        self.held = ""                      # text a pattern may still match
        self.fallback: tuple[Pattern, int] | None = None   # a section's end a next call may still beat
        self.started = False                # content began (generic: a call or reply only at the start)
        self.depth = 0                      # ARGS: JSON nesting depth
        self.in_string = self.escaped = False
        self.escape = ""                    # REPLY: an escape sequence not yet complete
        self._out: list[Delta] = []
        self._queue: deque[str] = deque()   # characters to read (held text read again goes first)
        self._first, self._after = first_call(fmt), after_call(fmt)

    def feed(self, text: str) -> list[Delta]:
        self._queue.extend(text)
        self._drain()
        return self._take()

    def finish(self) -> list[Delta]:
        """The text ended: held content is content; after a call, unfinished closing text is
        dropped; a call still open stays incomplete (no ToolCallEnd)."""
        while self.fallback is not None or self.held:
            if self.fallback is not None:
                self._resolve()
            else:
                if self.mode is Mode.CONTENT:
                    self._content(self.held)
                self.held = ""
            self._drain()
        return self._take()

    # -- one character --------------------------------------------------------------------------
    def _drain(self) -> None:
        """Read queued characters (a loop, not recursion: text read again is queued first)."""
        while self._queue:
            self._char(self._queue.popleft())

    def _again(self, text: str) -> None:
        self._queue.extendleft(reversed(text))

    def _char(self, c: str) -> None:
        if self.mode is Mode.ARGS:
            self._args(c)
        elif self.mode is Mode.REPLY:
            self._reply(c)
        elif self._candidates():
            self.held += c
            self._match()
        else:
            self._content(c)

    def _candidates(self) -> list[Pattern]:
        if self.mode is Mode.AFTER:
            return self._after
        if self.mode is Mode.AFTER_REPLY:
            return [REPLY_END]
        return self._first if not (self.fmt.envelope and self.started) else []

    def _match(self) -> None:
        results = [(p, p.match(self.held)) for p in self._candidates()]
        alive = any(m.state is Match.MAYBE for _, m in results)
        for pattern, m in results:
            if m.state is Match.YES:
                if pattern.kind != "end" or not alive:
                    self._enter(pattern, m.name)
                    return
                self.fallback = (pattern, len(self.held))     # take it unless a next call follows
        if alive:
            return
        if self.fallback is not None:
            self._resolve()
        else:
            self._fail()

    def _resolve(self) -> None:
        """Take the remembered section end; the text after it is read again."""
        assert self.fallback is not None
        (pattern, n), self.fallback = self.fallback, None
        rest = self.held[n:]
        self._enter(pattern, None)
        self._again(rest)

    def _fail(self) -> None:
        """No pattern can match the held text. In content its first character is content and
        the rest is read again; after a call (or reply) the text is content again."""
        held, self.held = self.held, ""
        if self.mode is not Mode.CONTENT:
            self.mode = Mode.CONTENT
            self.started = True
            self._again(held)
            return
        self._content(held[0])
        self._again(held[1:])

    def _enter(self, pattern: Pattern, name: str | None) -> None:
        self.held, self.fallback = "", None
        if pattern.kind == "call":
            assert name is not None
            index = len(self.output.calls)
            self._emit(ToolCallDelta(index, "", id=self.new_id(), name=name))
            self._emit(ToolCallDelta(index, "{"))
            self.mode, self.depth, self.in_string, self.escaped = Mode.ARGS, 1, False, False
        elif pattern.kind == "reply":
            self.mode, self.escape = Mode.REPLY, ""
        else:                                              # a section's or the reply's end
            self.mode, self.started = Mode.CONTENT, True

    # -- inside a call's arguments or the generic reply ---------------------------------------
    def _args(self, c: str) -> None:
        index = len(self.output.calls) - 1
        self._emit(ToolCallDelta(index, c))
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
        elif c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if self.depth == 0:
                self._emit(ToolCallEnd(index))
                self.mode = Mode.AFTER

    def _reply(self, c: str) -> None:
        if self.escape:
            done = _unescape(self.escape + c)
            if done is None:
                self.escape += c
                return
            text, rest = done
            self.escape = ""
            self._content(text)
            for r in rest:
                self._reply(r)
        elif c == "\\":
            self.escape = c
        elif c == '"':
            self.mode = Mode.AFTER_REPLY
        else:
            self._content(c)

    # -- output ---------------------------------------------------------------------------------
    def _content(self, text: str) -> None:
        self.started = True
        self._emit(ContentDelta(text))

    def _emit(self, delta: Delta) -> None:
        """Fold into the output, and into this feed's deltas (adjacent pieces joined)."""
        self.output.apply(delta)
        last = self._out[-1] if self._out else None
        if isinstance(delta, ContentDelta) and isinstance(last, ContentDelta):
            self._out[-1] = ContentDelta(last.text + delta.text)
        elif (isinstance(delta, ToolCallDelta) and isinstance(last, ToolCallDelta) and delta.id is None
              and last.id is None and last.index == delta.index):      # a call's first delta stays alone
            self._out[-1] = ToolCallDelta(last.index, last.arguments + delta.arguments)
        else:
            self._out.append(delta)

    def _take(self) -> list[Delta]:
        out, self._out = self._out, []
        return out


def _unescape(escape: str) -> tuple[str, str] | None:
    """(text, characters to read again) of a JSON escape, or None while it may still grow.
    A surrogate pair is one character; a lone surrogate becomes U+FFFD (UTF-8 cannot carry it)."""
    if escape[1] != "u":
        try:
            return json.loads(f'"{escape}"'), ""
        except ValueError:
            return "\ufffd", ""
    if len(escape) < 6:
        return None
    try:
        code = int(escape[2:6], 16)
    except ValueError:
        return "\ufffd", escape[6:]
    if 0xDC00 <= code < 0xE000:
        return "\ufffd", ""
    if not 0xD800 <= code < 0xDC00:
        return chr(code), ""
    tail = escape[6:]                                     # a high surrogate: its low half next?
    if len(tail) < 6 and tail[:2] == "\\u"[:len(tail)]:
        return None
    if len(tail) == 6 and tail[:2] == "\\u":
        try:
            low = int(tail[2:], 16)
        except ValueError:
            low = -1
        if 0xDC00 <= low < 0xE000:
            return chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)), ""
    return "\ufffd", tail


def parse_tool_output(text: str, fmt: ToolFormat, new_id: Callable[[], str] = new_call_id) -> ToolOutput:
    """The whole text parsed: content and calls (the stream parser fed everything at once)."""
    parser = ToolStreamParser(fmt, new_id)
    parser.feed(text)
    parser.finish()
    return parser.output
