"""Incremental detokenizer: token ids in, complete UTF-8 text out, in the prompt's context.

Contract (tested for every decoder kind, every prompt/output split, specials on and off):

    detok.prompt_text + everything `add` returned + `flush()` == tokenizer.decode(prompt + output)

and where the full decode extends the prompt's own decode, the output is exactly what it adds:
the prompt's text is never sent again. `prompt_text` is the prompt's share: its decode, with a
held tail (half a character, an open byte-fallback run) decided by the output. A character the
output completes is the output's; one the output proves invalid stays the prompt's U+FFFD.

Invalid bytes are U+FFFD as soon as they are known invalid (as `bytes.decode("utf-8",
"replace")` and the tokenizer say); only a valid but unfinished character is held, and only one
holding output bytes fails a strict flush.

Two implementations, chosen by the tokenizer (`byte_pieces`):

- ByteStream: exact per-token bytes through an incremental UTF-8 decoder. SentencePiece byte
  fallback decodes a run of <0xNN> tokens as one unit, as `tokenizers` does (valid UTF-8 gives
  its text, anything else one U+FFFD per byte), so a run is held until a normal token (or the
  end) closes it, or until it can no longer be valid (then each of its bytes is U+FFFD at
  once). A run the prompt ended with in complete text is settled, but an output run that
  continues it without a normal token between re-decides it, as the batch decode would.
- WindowStream: any `tokenizers` decoder. It decodes a short window of ids (a few tokens of
  context, then the unsent ones) with the tokenizer itself, and sends what the window's text
  adds once it is stable: never a trailing U+FFFD (possibly half a character) or the text of
  an open byte-fallback run that may still be valid. Text already sent must stay a prefix of
  the window's text; a decoder that breaks that raises DetokenizerError (the request fails,
  nothing is resent).
"""
from __future__ import annotations

import codecs
from typing import Protocol

from ...model.tokenizer import BytePieces, TokenizerLike

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
    """The incremental detokenizer for this tokenizer: ByteStream over exact per-token bytes
    where it has them, else WindowStream (decode a window, emit what it adds)."""
    pieces = tokenizer.byte_pieces
    if pieces is not None:
        return ByteStream(tokenizer, pieces, prompt_ids, skip_special_tokens)
    return WindowStream(tokenizer, prompt_ids, skip_special_tokens)




def _unfinished(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def _valid_prefix(data: bytes) -> bool:
    """Whether data is valid UTF-8 or a valid start of it (more bytes may still complete it)."""
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError as e:
        return e.reason == "unexpected end of data"      # only ever at the very end


class ByteStream:
    """Exact bytes per token. Where the text of the prompt and of the output meet:

        prompt bytes ... [held: k prompt bytes | output bytes ...]
                          ^ an unfinished character, or an open byte-fallback run

    The held prompt bytes are resolved by the output: a character they start and the output
    completes is the output's; one the output proves invalid is the prompt's U+FFFD (the output
    is what the full decode adds after the prompt's). A byte-fallback run is one unit (valid
    UTF-8 as a whole, else one U+FFFD per byte): the prompt keeps the complete text it ended
    with, and its share of the U+FFFDs when the run turns out invalid.
    """

    def __init__(self, tokenizer: TokenizerLike, pieces: BytePieces, prompt_ids: list[int],
                 skip_special_tokens: bool) -> None:
        self._tok = tokenizer
        self._pieces = pieces
        self._skip = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = True                  # no shown token yet (WordPiece / Metaspace treat it apart)
        self._strip = pieces.strip_first    # leading spaces of the text still to drop
        self._run = bytearray()             # an open run of byte-fallback tokens
        self._run_bad = False               # ... that can no longer be valid: its bytes are U+FFFD, shown
        self._run_check = codecs.getincrementaldecoder("utf-8")("strict")    # ... else valid so far
        self._prompt_run = 0                # leading bytes of the open run that are the prompt's
        self._prompt_held = 0               # bytes the UTF-8 decoder holds that are the prompt's
        self._settled = ""                  # the prompt's closing run as text (complete UTF-8) ...
        self._settled_shown = ""            # ... and as shown in prompt_text (after the Strip decoder)
        self._prompt_text = ""
        text = "".join(self.add(t) for t in prompt_ids)
        self._prompt_text += text
        if self._run and not self._run_bad:
            self._prompt_run = len(self._run)
            if not _unfinished(bytes(self._run)):
                self._settled = bytes(self._run).decode("utf-8")
                self._settled_shown = self._stripped(self._settled)
                self._prompt_text += self._settled_shown
        self._prompt_held = len(self._utf8.getstate()[0])

    @property
    def prompt_text(self) -> str:
        """The prompt's share of the full decode so far (its held tail is decided by the output)."""
        return self._prompt_text

    def add(self, token_id: int) -> str:
        """Text completed by this token: possibly "", never half a character. Unknown ids
        (beyond the tokenizer's vocabulary) and skipped special tokens add nothing."""
        if not self._tok.is_shown(token_id, self._skip):
            return ""
        first, self._first = self._first, False
        byte = self._pieces.byte_fallback_value(token_id)
        if byte is not None:
            self._run.append(byte)
            if self._run_bad:
                return self._stripped("\ufffd")     # the run is invalid already: so is each new byte
            try:
                self._run_check.decode(bytes([byte]))
                return ""                            # held: it may still be valid as a whole
            except UnicodeDecodeError:
                self._run_bad = True
            return self._invalid_run()
        text = self._close_run() if self._run else ""
        return text + self._decode(self._pieces.token_bytes(token_id, first))

    def _decode(self, data: bytes) -> str:
        held = self._utf8.getstate()[0]
        text = self._utf8.decode(data)
        if self._prompt_held and text:
            prompt_bytes, self._prompt_held = held[:self._prompt_held], 0
            if text[0] == "\ufffd" and not (held + data).startswith("\ufffd".encode()):
                # the prompt's held bytes never completed a character: their U+FFFDs (one per
                # maximal invalid subpart: ED A0 is two) are the prompt's
                n = len(prompt_bytes.decode("utf-8", "replace"))
                self._prompt_text += self._stripped("\ufffd" * n)
                text = text[n:]
        return self._stripped(text)

    def _invalid_run(self) -> str:
        """The run is not valid UTF-8: one U+FFFD per byte, the prompt's bytes' in the prompt."""
        if self._settled_shown:
            self._prompt_text = self._prompt_text[:len(self._prompt_text) - len(self._settled_shown)]
        # (complete text that a Strip decoder left out of the prompt's decode claims nothing)
        k = self._prompt_run if self._settled_shown or not self._settled else 0
        self._settled = self._settled_shown = ""
        self._prompt_run = 0
        self._prompt_text += self._stripped("\ufffd" * k)
        return self._stripped("\ufffd" * (len(self._run) - k))

    def _close_run(self) -> str:
        if self._run_bad:                        # shown byte by byte already
            text = ""
        elif _unfinished(bytes(self._run)):      # it ended inside a character
            text = self._invalid_run()
        else:
            text = self._stripped(bytes(self._run).decode("utf-8")[len(self._settled):])
        self._run.clear()
        self._run_bad = False
        self._run_check.reset()
        self._prompt_run = 0
        self._settled = self._settled_shown = ""
        return text

    def _stripped(self, text: str) -> str:
        while self._strip and text:
            if text[0] != " ":
                self._strip = 0
                break
            text = text[1:]
            self._strip -= 1
        return text

    def flush(self, errors: str = STRICT) -> str:
        """End of output. An unfinished character that holds output bytes raises Utf8TailError
        under "strict" and becomes U+FFFD under "replace"; bytes already known invalid are
        U+FFFD either way, and a character only the prompt left unfinished is the prompt's."""
        run, held = bytes(self._run), self._utf8.getstate()[0]
        unfinished = ((run if not self._run_bad and len(run) > self._prompt_run and _unfinished(run) else b"")
                      + (held if len(held) > self._prompt_held else b""))
        if errors == STRICT and unfinished:
            raise Utf8TailError(f"output ends inside a UTF-8 character (pending bytes {unfinished.hex(' ')})")
        text = self._close_run() if self._run else ""
        tail = self._utf8.decode(b"", final=True)
        if self._prompt_held and tail:
            # the tail is U+FFFDs only; as many as the prompt's held bytes make alone are the
            # prompt's, the rest the output's (ED A1: the decoder held both, '\ufffd\ufffd' is one each)
            n = len(held[:self._prompt_held].decode("utf-8", "replace"))
            self._prompt_held = 0
            self._prompt_text += self._stripped(tail[:n])
            tail = tail[n:]
        return text + self._stripped(tail)


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
        self._prompt_window = self._text      # the prompt's part of the window, as the prompt decodes
        self._sent = len(self._text)          # chars of the window already prompt or sent
        self._emitted = False
        self._prompt_ids = list(prompt_ids)
        self._prompt_full: str | None = None
        self._prompt_split = (0, "")          # set when the output's first text is sent
        self._undecided = self._trailing_replacements(self._text, 0)   # the prompt's open tail
        self._run = bytearray()               # the open byte-fallback run at the end of the ids
        for t in self._ids:
            self._note_run(t)
        self._prompt_run = len(self._run)     # the prompt's closing run (bytes)
        self._run_prompt_bytes = len(self._run)   # leading bytes of the open run that are the prompt's
        self._shared_run = 0                  # output bytes that continued the prompt's run

    @property
    def prompt_text(self) -> str:
        """The prompt's share of the full decode (its tail is decided by the output's first text)."""
        if self._prompt_full is None:
            self._prompt_full = self._tok.decode(self._prompt_ids, self._skip)
        if not self._emitted:
            return self._prompt_full[:len(self._prompt_full) - self._undecided]
        # the window's prompt text keeps its first `common` characters and ends with `redecided`
        common, redecided = self._prompt_split
        return self._prompt_full[:len(self._prompt_full) - (len(self._prompt_window) - common)] + redecided

    def _is_byte(self, token_id: int) -> bool:
        return self._tok.byte_fallback_value(token_id) is not None

    def _note_run(self, token_id: int) -> None:
        byte = self._tok.byte_fallback_value(token_id)
        if byte is None:
            self._run.clear()
            self._run_prompt_bytes = 0
        else:
            self._run.append(byte)

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
        self._note_run(token_id)
        if self._run_prompt_bytes:             # the prompt's run goes on
            self._shared_run += 1
        self._undecided = 0
        return self._advance(self._decode(self._ids), final=False)

    def _output_start(self, new: str) -> tuple[int, int]:
        """Before any text is sent: how much of the prompt's window text the new decode keeps,
        and where the output's text starts in it.
        What the prompt decoded to stays the prompt's; a tail the output changed (a character
        it completed) is the output's; a prompt byte-fallback run that the output's bytes made
        invalid keeps one U+FFFD per prompt byte in the prompt."""
        prompt = self._prompt_window
        common = 0
        for a, b in zip(prompt, new):
            if a != b:
                break
            common += 1
        settled = len(prompt) - self._trailing_replacements(prompt, 0)
        if common < settled and self._shared_run:
            return common, min(len(new), common + self._prompt_run)
        return common, common

    def _advance(self, new: str, final: bool) -> str:
        if self._emitted:
            if not new.startswith(self._text[:self._sent]):
                raise DetokenizerError("the tokenizer's decode changed text that was already sent "
                                       f"({self._text[:self._sent][-20:]!r} -> {new[:self._sent][-20:]!r})")
            start = self._sent
        else:
            common, start = self._output_start(new)
        self._text = new
        end = len(new) if final else len(new) - self._held(new, start)
        if end <= start:
            return ""
        if not self._emitted:              # the split between prompt and output is fixed now
            self._emitted = True
            self._prompt_split = (common, new[common:start])
        out = new[start:end]
        self._sent = end
        self._slide()
        return out

    def _held(self, text: str, start: int) -> int:
        """Characters at the end that the next token may still change."""
        if self._run:
            # an open byte-fallback run: held while it may still be valid (it decodes as a unit);
            # once it cannot be, its text is one U+FFFD per byte whatever follows
            return len(text) - start if _valid_prefix(bytes(self._run)) else 0
        return self._trailing_replacements(text, start)

    def _trailing_replacements(self, text: str, start: int) -> int:
        """U+FFFD at the end of text[start:]: possibly half a character, when decoders make bytes."""
        if not self._tok.splits_characters:
            return 0
        n = 0
        while n < len(text) - start and text[len(text) - 1 - n] == "\ufffd":
            n += 1
        return n

    def _slide(self) -> None:
        if len(self._ids) <= self.MAX_WINDOW or self._sent != len(self._text) or self._run:
            return
        start = self._window_start(self._ids, len(self._ids) - self.CONTEXT)
        self._ids = self._ids[start:]
        self._text = self._decode(self._ids)
        self._sent = len(self._text)

    def flush(self, errors: str = STRICT) -> str:
        self._undecided = 0
        if errors == STRICT and self._unfinished_tail():
            raise Utf8TailError("output ends inside a UTF-8 character")
        return self._advance(self._text, final=True)

    def _unfinished_tail(self) -> bool:
        """Whether the output's bytes end inside a character: exact for a byte-fallback run; for
        other byte-making decoders an unsent trailing U+FFFD counts (the text cannot tell)."""
        run = bytes(self._run)
        if run:
            return len(run) > self._run_prompt_bytes and _unfinished(run) and _valid_prefix(run)
        start = self._sent if self._emitted else self._output_start(self._text)[1]
        return self._tok.splits_characters and self._text[start:].endswith("\ufffd")
