"""Incremental detokenizer: token ids in, complete UTF-8 text out, in the prompt's context.

Contract (tested for every decoder kind, every prompt/output split, specials on and off):

    detok.prompt_text + everything `add` returned + `flush()` == tokenizer.decode(prompt + output)

`prompt_text` is the prompt's settled text: the decode of the prompt, less a tail that the
output may still change (half a character, an open byte-fallback run). That tail belongs to
the output. A prompt that ends in a complete character, or a complete byte-fallback run, is
settled: the output starts after it.

Two implementations, chosen by the tokenizer (`byte_pieces`):

- ByteStream: exact per-token bytes through an incremental UTF-8 decoder. SentencePiece byte
  fallback decodes a run of <0xNN> tokens as one unit, as `tokenizers` does (valid UTF-8 gives
  its text, anything else one U+FFFD per byte), so a run is held until a normal token (or the
  end) closes it. A run the prompt ended with is settled, but an output run that continues it
  without a normal token between re-decides it, as the batch decode would.
- WindowStream: any `tokenizers` decoder. It decodes a short window of ids (a few tokens of
  context, then the unsent ones) with the tokenizer itself, and sends what the window's text
  adds once it is stable: never a trailing U+FFFD (possibly half a character) or the text of
  an open byte-fallback run. Text already sent must stay a prefix of the window's text; a
  decoder that breaks that raises DetokenizerError (the request fails, nothing is resent).
"""
from __future__ import annotations

import codecs
from typing import Protocol

from ..model.tokenizer import BytePieces, TokenizerLike

STRICT, REPLACE = "strict", "replace"


class Utf8TailError(ValueError):
    """The output ended inside a UTF-8 character."""


class DetokenizerError(RuntimeError):
    """The tokenizer's decode changed text that was already sent."""


class Detokenizer(Protocol):
    @property
    def prompt_text(self) -> str: ...

    def add(self, token_id: int) -> str: ...

    def flush(self, errors: str = STRICT) -> str: ...


def make_detokenizer(tokenizer: TokenizerLike, prompt_ids: list[int], skip_special_tokens: bool = True
                     ) -> Detokenizer:
    pieces = tokenizer.byte_pieces
    if pieces is not None:
        return ByteStream(tokenizer, pieces, prompt_ids, skip_special_tokens)
    return WindowStream(tokenizer, prompt_ids, skip_special_tokens)


IncrementalDetokenizer = make_detokenizer     # the name the tests and users know


def _unfinished(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


class ByteStream:
    def __init__(self, tokenizer: TokenizerLike, pieces: BytePieces, prompt_ids: list[int],
                 skip_special_tokens: bool) -> None:
        self._tok = tokenizer
        self._pieces = pieces
        self._skip = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = True                  # no shown token yet (WordPiece / Metaspace treat it apart)
        self._strip = pieces.strip_first    # leading spaces of the text still to drop
        self._run = bytearray()             # an open run of byte-fallback tokens
        self._settled = b""                 # the prompt's closing run, taken as prompt text
        self._settled_text = ""
        text = "".join(self.add(t) for t in prompt_ids)
        if self._run and not _unfinished(bytes(self._run)) and not self._utf8.getstate()[0]:
            self._settled = bytes(self._run)
            self._settled_text = self._close_run()
            text += self._settled_text
        self.prompt_text = text

    def add(self, token_id: int) -> str:
        """Text completed by this token: possibly "", never half a character. Unknown ids
        (beyond the tokenizer's vocabulary) and skipped special tokens add nothing."""
        if not self._tok.is_shown(token_id, self._skip):
            return ""
        first, self._first = self._first, False
        byte = self._pieces.byte_fallback_value(token_id)
        if byte is not None:
            if self._settled and not self._run:    # the prompt's run goes on: decide it again
                self._run[:0] = self._settled
            self._run.append(byte)
            return ""
        text = self._close_run() if self._run else ""
        self._settled = b""
        text += self._utf8.decode(self._pieces.token_bytes(token_id, first))
        return self._stripped(text) if self._strip else text

    def _close_run(self) -> str:
        data = bytes(self._run)
        self._run.clear()
        if self._settled and data.startswith(self._settled) and len(data) > len(self._settled):
            settled, self._settled = self._settled, b""
            if not _unfinished(data):            # still valid: the prompt keeps its part
                return data[len(settled):].decode("utf-8")
            # invalid as a whole: every byte is U+FFFD, the prompt's part included
            self.prompt_text = self.prompt_text[:len(self.prompt_text) - len(self._settled_text)]
            return "\ufffd" * len(data)
        try:
            return self._stripped(data.decode("utf-8"))
        except UnicodeDecodeError:
            return self._stripped("\ufffd" * len(data))

    def _stripped(self, text: str) -> str:
        while self._strip and text:
            if text[0] != " ":
                self._strip = 0
                break
            text = text[1:]
            self._strip -= 1
        return text

    def flush(self, errors: str = STRICT) -> str:
        """End of output. Bytes that are not valid UTF-8 (an unfinished character) raise
        Utf8TailError under "strict" and become U+FFFD under "replace"."""
        tail = bytes(self._run) + self._utf8.getstate()[0]
        if errors == STRICT and tail and _unfinished(tail):
            raise Utf8TailError(f"output ends inside a UTF-8 character (pending bytes {tail.hex(' ')})")
        text = self._close_run()
        return self._stripped(text + self._utf8.decode(b"", final=True))


class WindowStream:
    CONTEXT = 6          # tokens of already-sent text kept in front of the unsent ones
    MAX_WINDOW = 48      # slide the window forward once it holds this many

    def __init__(self, tokenizer: TokenizerLike, prompt_ids: list[int], skip_special_tokens: bool) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        shown = [t for t in prompt_ids if tokenizer.is_shown(t, skip_special_tokens)]
        start = self._window_start(shown, len(shown) - self.CONTEXT)
        self._ids = shown[start:]
        self._text = self._decode(self._ids)
        self._window_prompt = len(self._text)
        self._prompt_end = len(self._text)    # chars of the window that are prompt (may move back)
        self._sent = self._prompt_end         # chars of the window already prompt or sent
        self._emitted = False
        self._moved_back = 0
        self._prompt_ids = list(prompt_ids)
        self._prompt_full: str | None = None
        self._undecided = self._trailing_replacements(self._text, 0)   # the prompt's open tail

    @property
    def prompt_text(self) -> str:
        """The prompt's settled text (its tail may move to the output until text is sent)."""
        if self._prompt_full is None:
            self._prompt_full = self._tok.decode(self._prompt_ids, self._skip)
        moved_back = self._window_prompt - self._prompt_end if not self._emitted else self._moved_back
        return self._prompt_full[:len(self._prompt_full) - max(moved_back, self._undecided)]

    def _is_byte(self, token_id: int) -> bool:
        return self._tok.byte_fallback_value(token_id) is not None

    def _window_start(self, ids: list[int], start: int) -> int:
        """Never start a window inside a byte-fallback run (its decode depends on all of it)."""
        start = max(0, start)
        while 0 < start < len(ids) and self._is_byte(ids[start]) and self._is_byte(ids[start - 1]):
            start -= 1
        return start

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, self._skip) if ids else ""

    def add(self, token_id: int) -> str:
        if not self._tok.is_shown(token_id, self._skip):
            return ""
        self._ids.append(token_id)
        self._undecided = 0
        return self._advance(self._decode(self._ids), final=False)

    def _advance(self, new: str, final: bool) -> str:
        if not self._emitted:
            # before anything is sent, the prompt's own tail may turn out unfinished
            common = 0
            for a, b in zip(self._text[:self._prompt_end], new):
                if a != b:
                    break
                common += 1
            self._prompt_end = min(self._prompt_end, common)
            self._sent = self._prompt_end
        elif not new.startswith(self._text[:self._sent]):
            raise DetokenizerError("the tokenizer's decode changed text that was already sent "
                                   f"({self._text[:self._sent][-20:]!r} -> {new[:self._sent][-20:]!r})")
        self._text = new
        end = len(new) if final else len(new) - self._held(new)
        if end <= self._sent:
            return ""
        out = new[self._sent:end]
        self._sent = end
        if not self._emitted:
            self._emitted = True
            self._moved_back = self._window_prompt - self._prompt_end
        self._slide()
        return out

    def _held(self, text: str) -> int:
        """Characters at the end that the next token may still change."""
        if self._ids and self._is_byte(self._ids[-1]):
            return len(text) - self._sent            # an open byte-fallback run: hold it all
        return self._trailing_replacements(text, self._sent)

    def _trailing_replacements(self, text: str, start: int) -> int:
        """U+FFFD at the end of text[start:]: possibly half a character, when decoders make bytes."""
        if not self._tok.splits_characters:
            return 0
        n = 0
        while n < len(text) - start and text[len(text) - 1 - n] == "\ufffd":
            n += 1
        return n

    def _slide(self) -> None:
        if len(self._ids) <= self.MAX_WINDOW or self._sent != len(self._text) or self._is_byte(self._ids[-1]):
            return
        start = self._window_start(self._ids, len(self._ids) - self.CONTEXT)
        self._ids = self._ids[start:]
        self._text = self._decode(self._ids)
        self._sent = self._prompt_end = len(self._text)

    def flush(self, errors: str = STRICT) -> str:
        self._undecided = 0
        tail = self._text[self._sent:]
        if errors == STRICT and tail and self._unfinished_tail(tail):
            raise Utf8TailError("output ends inside a UTF-8 character")
        return self._advance(self._text, final=True)

    def _unfinished_tail(self, tail: str) -> bool:
        run = bytearray()
        for t in reversed(self._ids):
            b = self._tok.byte_fallback_value(t)
            if b is None:
                break
            run[:0] = bytes([b])
        if run:
            return _unfinished(bytes(run))
        return self._tok.splits_characters and tail.endswith("\ufffd")
