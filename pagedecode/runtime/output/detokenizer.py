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

from typing import Protocol

from ...model.tokenizer import TokenizerLike
from .byte_stream import ByteStream
from .utf8 import REPLACE, STRICT, DetokenizerError, Utf8TailError
from .window_stream import WindowStream

__all__ = ["Detokenizer", "make_detokenizer", "ByteStream", "WindowStream", "STRICT", "REPLACE",
           "DetokenizerError", "Utf8TailError"]


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
