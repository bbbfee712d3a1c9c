"""Tokenizer: `tokenizers` for encode and decode, plus each token's exact bytes for streaming.

The incremental detokenizer needs bytes, not text: half a UTF-8 character must be held, not
shown as U+FFFD. `token_bytes(id, first)` gives the bytes a token contributes to the batch
decode, for the decoder families accepted here (they are all context-free per token, apart
from "is this the first shown token"):

    ByteLevel (GPT-2, Llama 3, Qwen)      chars mapped back through the byte alphabet
    SentencePiece style (Llama 2, Mistral) "▁" -> space; <0xNN> tokens are bytes, decoded a run
                                           at a time (byte_fallback_value); `strip_first`
                                           leading spaces of the text are dropped (Strip / Metaspace)
    WordPiece (BERT)                      "##" joins, other tokens get a space, cleanup rules
    no decoder                            the token text as is
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable, Sequence

from ..errors import ModelLoadError

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_WORDPIECE_CLEANUP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                      (" n't", "n't"), (" 'm", "'m"), (" do not", " don't"), (" 's", "'s"),
                      (" 've", "'ve"), (" 're", "'re"))


def byte_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted: char -> byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = keep[:]
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def _decoder_kind(decoder: dict | None) -> tuple[str, int, bool, dict]:
    """(kind, leading spaces to strip from the first shown token, byte fallback, options)."""
    if decoder is None:
        return "plain", 0, False, {}
    kind = decoder.get("type")
    if kind == "ByteLevel":
        return "bytelevel", 0, False, {}
    if kind == "WordPiece":
        return "wordpiece", 0, False, {"prefix": decoder.get("prefix", "##"),
                                       "cleanup": decoder.get("cleanup", True)}
    if kind == "Metaspace":
        strip = 0 if decoder.get("prepend_scheme", "always") == "never" else 1
        return "sentencepiece", strip, False, {"replacement": decoder.get("replacement", "▁")}
    if kind == "Sequence":
        parts = decoder.get("decoders", [])
        types = [p.get("type") for p in parts]
        if set(types) <= {"Replace", "ByteFallback", "Fuse", "Strip"}:
            strip, replacement = 0, "▁"
            for p in parts:
                if p["type"] == "Strip":
                    if p.get("content") != " " or p.get("stop", 0) != 0:
                        break
                    strip = p.get("start", 0)
                if p["type"] == "Replace":
                    if p.get("content") != " " or "String" not in p.get("pattern", {}):
                        break
                    replacement = p["pattern"]["String"]
            else:
                return "sentencepiece", strip, "ByteFallback" in types, {"replacement": replacement}
    raise ModelLoadError(f"unsupported tokenizer decoder {json.dumps(decoder)[:200]}; supported: "
                         "ByteLevel, Metaspace / SentencePiece sequences, WordPiece")


class Tokenizer:
    """A `tokenizers.Tokenizer` with the model's BOS/EOS rules and exact per-token bytes."""

    def __init__(self, tok, *, add_bos: bool | None = None, add_eos: bool = False,
                 bos_token_id: int | None = None, eos_token_ids: Iterable[int] = ()) -> None:
        self._tok = tok
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        spec = json.loads(tok.to_str())
        self.kind, self.strip_first, self.byte_fallback, self._opts = _decoder_kind(spec.get("decoder"))
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
        self._alphabet = byte_alphabet() if self.kind == "bytelevel" else None
        self._pieces: dict[tuple[int, bool], bytes] = {}

    @classmethod
    def from_dir(cls, path: str | Path, eos_token_ids: Iterable[int] = (),
                 bos_token_id: int | None = None) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ModelLoadError(f"missing tokenizer file: {file}")
        tok = HFTokenizer.from_file(str(file))
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        if bos_token_id is None and isinstance(cfg.get("bos_token"), str):
            bos_token_id = tok.token_to_id(cfg["bos_token"])
        eos = list(eos_token_ids)
        named_eos = tok.token_to_id(cfg["eos_token"]) if isinstance(cfg.get("eos_token"), str) else None
        if not eos and named_eos is not None:
            eos = [named_eos]
        return cls(tok, add_bos=cfg.get("add_bos_token"), add_eos=bool(cfg.get("add_eos_token", False)),
                   bos_token_id=bos_token_id, eos_token_ids=eos)

    # -- encode / decode ---------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Prompt ids. With add_bos_token in tokenizer_config.json, BOS is added by that rule;
        without it, the tokenizer's own post-processor decides (as transformers does)."""
        if self.add_bos is None:
            return self._tok.encode(text, add_special_tokens=True).ids
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None:
            ids = [int(self.bos_token_id)] + ids
        if self.add_eos and self.eos_token_ids:
            ids = ids + [self.eos_token_ids[0]]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([i for i in ids if 0 <= i < self.vocab_size],
                                skip_special_tokens=skip_special_tokens)

    # -- bytes for streaming -----------------------------------------------------------------
    def is_shown(self, token_id: int, skip_special_tokens: bool) -> bool:
        """Whether the token reaches the decoder at all (unknown ids and skipped specials don't)."""
        if not 0 <= token_id < self.vocab_size:
            return False
        return not (skip_special_tokens and token_id in self.special_ids)

    def byte_fallback_value(self, token_id: int) -> int | None:
        """The byte a <0xNN> token stands for, under a ByteFallback decoder; else None."""
        if not self.byte_fallback:
            return None
        s = self._tok.id_to_token(token_id)
        m = _BYTE_TOKEN.fullmatch(s) if s is not None else None
        return int(m.group(1), 16) if m else None

    def token_bytes(self, token_id: int, first: bool) -> bytes:
        """Bytes this token adds to the batch decode; `first`: it is the first shown token."""
        key = (token_id, first)
        piece = self._pieces.get(key)
        if piece is None:
            piece = self._pieces[key] = self._piece(token_id, first)
        return piece

    def _piece(self, token_id: int, first: bool) -> bytes:
        s = self._tok.id_to_token(token_id)
        if s is None:
            return b""
        if self.kind == "bytelevel":
            alphabet = self._alphabet or {}
            if all(c in alphabet for c in s):
                return bytes(alphabet[c] for c in s)
            return s.encode()
        if self.kind == "sentencepiece":
            return s.replace(self._opts["replacement"], " ").encode()
        if self.kind == "wordpiece":
            prefix = self._opts["prefix"]
            if not first:
                s = s.replace(prefix, "", 1) if s.startswith(prefix) else " " + s
            if self._opts["cleanup"]:
                for dirty, clean in _WORDPIECE_CLEANUP:
                    s = s.replace(dirty, clean)
            return s.encode()
        return s.encode()
