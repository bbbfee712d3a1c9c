"""Incremental detokenizer: token ids in, complete UTF-8 text out, in the prompt's context.

Each token contributes exact bytes (Tokenizer.token_bytes); a UTF-8 incremental decoder holds
an unfinished character until its last byte arrives. The prompt is fed first and its text
dropped, so the output is decoded in context (SentencePiece's leading-space rule applies only
at the very start), and a character the prompt left unfinished belongs to the output.

SentencePiece byte fallback decodes a run of <0xNN> tokens as one unit, as `tokenizers` does:
valid UTF-8 gives its text, anything else one U+FFFD per byte token. So a run is held until a
normal token (or the end) closes it; runs are short (a character or a newline), so this costs
at most a step or two of latency.

Invariant: prompt text + everything `add` returned + `flush()` == the batch decode of
prompt + output ids (same skip_special_tokens), up to how the prompt's own unfinished tail is
shown (it is carried into the output rather than replaced in the prompt).
"""
from __future__ import annotations

import codecs


class Utf8TailError(ValueError):
    """The output ended inside a UTF-8 character."""


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = True          # no shown token yet (WordPiece joins the first without space)
        self._strip = getattr(tokenizer, "strip_first", 0)   # leading spaces still to drop
        self._byte_of = getattr(tokenizer, "byte_fallback_value", None)
        self._run = bytearray()     # an open run of byte-fallback tokens
        for t in prompt_ids:
            self.add(t)             # the prompt's text is not output; an unfinished tail stays

    def add(self, token_id: int) -> str:
        """Text completed by this token: possibly "", never half a character. Unknown ids
        (beyond the tokenizer's vocabulary) and skipped special tokens add nothing."""
        if not self._tok.is_shown(token_id, self._skip):
            return ""
        first, self._first = self._first, False
        byte = self._byte_of(token_id) if self._byte_of is not None else None
        if byte is not None:
            self._run.append(byte)
            return ""
        text = self._close_run()
        return self._stripped(text + self._utf8.decode(self._tok.token_bytes(token_id, first)))

    def _close_run(self) -> str:
        data = bytes(self._run)
        self._run.clear()
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return "\ufffd" * len(data)

    def _stripped(self, text: str) -> str:
        while self._strip and text:
            if text[0] != " ":
                self._strip = 0
                break
            text = text[1:]
            self._strip -= 1
        return text

    @property
    def pending_bytes(self) -> bytes:
        return bytes(self._run) + self._utf8.getstate()[0]

    def flush(self, errors: str = "strict") -> str:
        """End of output. Bytes that are not valid UTF-8 (an unfinished character) raise
        Utf8TailError under "strict" and become U+FFFD under "replace"."""
        tail = self.pending_bytes
        if errors == "strict" and tail:
            try:
                tail.decode("utf-8")
            except UnicodeDecodeError:
                raise Utf8TailError(f"output ends inside a UTF-8 character (pending bytes {tail.hex(' ')})") from None
        text = self._close_run()
        return self._stripped(text + self._utf8.decode(b"", final=True))
