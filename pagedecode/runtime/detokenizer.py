"""Incremental detokenizer: token ids in, complete UTF-8 text out, in the prompt's context.

Each token contributes exact bytes (Tokenizer.token_bytes); a UTF-8 incremental decoder holds
an unfinished character until its last byte arrives. The prompt is fed first and its text
dropped, so the output is decoded in context (SentencePiece's leading-space rule applies only
at the very start), and a character the prompt left unfinished belongs to the output.

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
        self._first = True          # no shown token yet (SentencePiece strips its leading space)
        for t in prompt_ids:
            self.add(t)             # the prompt's text is not output; an unfinished tail stays

    def add(self, token_id: int) -> str:
        """Text completed by this token: possibly "", never half a character. Unknown ids
        (beyond the tokenizer's vocabulary) and skipped special tokens add nothing."""
        if not self._tok.is_shown(token_id, self._skip):
            return ""
        piece = self._tok.token_bytes(token_id, self._first)
        self._first = False
        return self._utf8.decode(piece)

    @property
    def pending_bytes(self) -> bytes:
        return self._utf8.getstate()[0]

    def flush(self, errors: str = "strict") -> str:
        """End of output. An unfinished character raises Utf8TailError under "strict" and becomes
        U+FFFD under "replace"."""
        tail = self.pending_bytes
        if tail and errors == "strict":
            raise Utf8TailError(f"output ends inside a UTF-8 character (pending bytes {tail.hex(' ')})")
        return self._utf8.decode(b"", final=True)
