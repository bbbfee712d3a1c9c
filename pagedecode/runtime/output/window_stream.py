"""WindowStream: the detokenizer over any `tokenizers` decoder, by decoding a short window of ids
(the contract is in detokenizer.py)."""
from __future__ import annotations

from ...model.tokenizer import TokenizerLike
from .utf8 import REPLACE, STRICT, DetokenizerError, Utf8TailError, unfinished, valid_prefix


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
        """Never start a window inside a byte-fallback run (its decode depends on all of it), nor
        at its first byte: a Strip decoder drops a window's leading space, and a run that turns
        invalid makes that space U+FFFD in the full decode, so the window's text would not be the
        prompt's tail (ids 0x20 0xC2 0x80, then 0x80: a space kept in the prompt's text)."""
        start = max(0, start)
        while 0 < start < len(ids) and self._is_byte(ids[start]):
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
            return len(text) - start if valid_prefix(bytes(self._run)) else 0
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
            return len(run) > self._run_prompt_bytes and unfinished(run) and valid_prefix(run)
        start = self._sent if self._emitted else self._output_start(self._text)[1]
        return self._tok.splits_characters and self._text[start:].endswith("\ufffd")
