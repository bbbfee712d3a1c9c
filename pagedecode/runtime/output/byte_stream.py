"""ByteStream: the detokenizer over exact per-token bytes (the contract is in detokenizer.py)."""
from __future__ import annotations

import codecs

from ...model.tokenizer import BytePieces, TokenizerLike
from .utf8 import STRICT, Utf8TailError, unfinished, valid_prefix


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
            if not unfinished(bytes(self._run)):
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
        elif unfinished(bytes(self._run)):      # it ended inside a character
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
        pending = ((run if not self._run_bad and len(run) > self._prompt_run and unfinished(run) else b"")
                   + (held if len(held) > self._prompt_held else b""))
        if errors == STRICT and pending:
            raise Utf8TailError(f"output ends inside a UTF-8 character (pending bytes {pending.hex(' ')})")
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
