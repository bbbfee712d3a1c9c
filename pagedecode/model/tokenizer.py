"""Tokenizer: `tokenizers` for encode and decode, plus, where provably exact, each token's bytes.

The incremental detokenizer (runtime/output/detokenizer.py) has two ways to stream text:

- a byte table (`BytePieces`): each token's exact bytes, for the decoder families whose
  batch decode is a per-token function (apart from "is this the first shown token"):

      ByteLevel (GPT-2, Llama 3, Qwen)        chars mapped back through the byte alphabet
      Metaspace (SentencePiece)               "▁" -> space; the first token loses one space
      Replace(▁ -> " "), ByteFallback, Fuse,  Llama 2 / Mistral: <0xNN> tokens are bytes,
      Strip(" ", n, 0) as a Sequence          decoded a run at a time; n leading spaces dropped
      WordPiece (BERT)                        "##" joins, other tokens get a space, cleanup

- for any other decoder (bare ByteFallback, other Strip / Replace forms, BPEDecoder, CTC,
  none at all, other Sequences) a sliding window of ids decoded by the tokenizer itself.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable, Protocol, Sequence, runtime_checkable

from ..errors import ModelLoadError
from .specials import SpecialTokenEscape

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_WORDPIECE_CLEANUP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                      (" n't", "n't"), (" 'm", "'m"), (" do not", " don't"), (" 's", "'s"),
                      (" 've", "'ve"), (" 're", "'re"))
# decoders that turn token text into bytes: their decode may end inside a character (U+FFFD)
_BYTE_DECODERS = ("ByteLevel", "ByteFallback")


class BytePieces(Protocol):
    """Exact per-token bytes, for the streaming fast path."""
    strip_first: int             # leading spaces of the decoded text to drop (a Strip decoder)

    def token_bytes(self, token_id: int, first: bool) -> bytes: ...

    def byte_fallback_value(self, token_id: int) -> int | None: ...


@runtime_checkable
class TokenizerLike(Protocol):
    """What the engine needs of a tokenizer. `pd.Tokenizer` and `pd.testing.ByteVocabTokenizer`
    are two; `as_tokenizer` wraps the objects users already have."""
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    byte_pieces: BytePieces | None     # None: stream by decoding a window of ids
    splits_characters: bool           # decode can end inside a character (shown as U+FFFD)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def is_shown(self, token_id: int, skip_special_tokens: bool) -> bool: ...

    def byte_fallback_value(self, token_id: int) -> int | None: ...


@runtime_checkable
class EscapesSpecialTokens(Protocol):
    """A tokenizer that keeps special-token strings typed in chat content plain text
    (model/specials.py): `pd.Tokenizer` is one."""

    def escape_specials(self, text: str) -> str: ...

    def encode_escaped(self, text: str) -> list[int]: ...


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


def _decoder_types(decoder: dict | None) -> list[str]:
    if decoder is None:
        return []
    if decoder.get("type") == "Sequence":
        return [t for d in decoder.get("decoders", []) for t in _decoder_types(d)]
    return [str(decoder.get("type"))]


def _fast_kind(decoder: dict | None) -> tuple[str, dict] | None:
    """(kind, options) when the decoder is one whose output is a per-token function; else None."""
    if decoder is None:
        return None
    kind = decoder.get("type")
    if kind == "ByteLevel":
        return "bytelevel", {}
    if kind == "WordPiece":
        return "wordpiece", {"prefix": decoder.get("prefix", "##"), "cleanup": decoder.get("cleanup", True)}
    if kind == "Metaspace":
        # the first token loses every "▁" (not only a leading one), unless prepend_scheme is never
        return "sentencepiece", {"replacement": decoder.get("replacement", "▁"), "strip": 0,
                                 "drop_first": decoder.get("prepend_scheme", "always") != "never"}
    if kind != "Sequence":
        return None
    # Llama 2 / Mistral: [Replace(▁ -> " "), ByteFallback, Fuse, Strip(" ", n, 0)], in that order
    parts = decoder.get("decoders", [])
    types = [p.get("type") for p in parts]
    if types not in (["Replace", "ByteFallback", "Fuse", "Strip"], ["Replace", "ByteFallback", "Fuse"],
                     ["Replace", "Fuse", "Strip"], ["Replace", "Fuse"]):
        return None
    rep = parts[0]
    pattern = rep.get("pattern", {})
    if rep.get("content") != " " or "String" not in pattern or len(pattern["String"]) != 1:
        return None
    strip = 0
    if types[-1] == "Strip":
        s = parts[-1]
        if s.get("content") != " " or s.get("stop", 0) != 0:
            return None
        strip = int(s.get("start", 0))
    return "sentencepiece", {"replacement": pattern["String"], "strip": strip, "drop_first": False}


class Tokenizer:
    """A `tokenizers.Tokenizer` with the model's BOS/EOS rules, and exact per-token bytes where
    the decoder allows them (`byte_pieces`)."""

    def __init__(self, tok: Any, *, add_bos: bool | None = None, add_eos: bool = False,
                 bos_token_id: int | None = None, eos_token_ids: Iterable[int] = (),
                 max_token_bytes: int | None = None) -> None:
        self._tok = tok
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(int(i) for i in eos_token_ids)
        decoder = _decoder_json(tok)
        self.decoder_types = _decoder_types(decoder)
        self.splits_characters = any(t in _BYTE_DECODERS for t in self.decoder_types)
        self.has_byte_fallback = "ByteFallback" in self.decoder_types
        fast = _fast_kind(decoder)
        self.kind, self._opts = fast if fast is not None else ("window", {})
        self.strip_first = int(self._opts.get("strip", 0))
        self.byte_pieces: BytePieces | None = self if fast is not None else None
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
        self._alphabet = byte_alphabet() if self.kind == "bytelevel" else None
        self._pieces: dict[tuple[int, bool], bytes] = {}
        self._max_token_bytes = max_token_bytes       # None: read from the vocabulary when first asked
        self._byte_values: dict[int, int | None] = {}
        self._escape: SpecialTokenEscape | None = None

    @classmethod
    def from_dir(cls, path: str | Path, eos_token_ids: Iterable[int] = (),
                 bos_token_id: int | None = None) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ModelLoadError(f"missing tokenizer file: {file}")
        try:
            tok = HFTokenizer.from_file(str(file))
        except Exception as e:
            raise ModelLoadError(f"{file} cannot be read by `tokenizers`: {e}") from None
        cfg_file = path / "tokenizer_config.json"
        try:
            cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{cfg_file} is not valid JSON: {e}") from None
        if bos_token_id is None:
            bos = _token_name(cfg.get("bos_token"))
            bos_token_id = tok.token_to_id(bos) if bos else None
        eos = list(eos_token_ids)
        named = _token_name(cfg.get("eos_token"))
        named_eos = tok.token_to_id(named) if named else None
        if not eos and named_eos is not None:
            eos = [named_eos]
        return cls(tok, add_bos=cfg.get("add_bos_token"), add_eos=bool(cfg.get("add_eos_token", False)),
                   bos_token_id=bos_token_id, eos_token_ids=eos)

    # -- encode / decode ---------------------------------------------------------------------
    @property
    def max_token_bytes(self) -> int:
        """At least the UTF-8 bytes of text any one token stands for: its vocabulary string's (a
        byte-level token's characters stand for a byte each, a SentencePiece piece writes a space
        as the 3-byte U+2581, a byte-fallback token "<0x41>" is 6). So a text of more than
        max_context times this many bytes cannot fit the context: refused before encoding it."""
        if self._max_token_bytes is None:
            self._max_token_bytes = max(len(s.encode()) for s in self._tok.get_vocab(with_added_tokens=True))
        return self._max_token_bytes

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of `text`. With add_special_tokens, BOS (and EOS) are added by tokenizer_config's
        add_bos_token / add_eos_token when it has them, else by the tokenizer's own
        post-processor (as transformers does). Text that is already rendered with its special
        tokens (a chat template) is encoded with add_special_tokens=False: no second BOS.
        Text that already begins with the BOS token's string (lm-eval's decoded requests, a
        prompt a client rendered itself) gets no second BOS either."""
        if not add_special_tokens:
            return list(self._tok.encode(text, add_special_tokens=False).ids)
        bos = self.bos_token_id
        if self.add_bos is None:
            ids = list(self._tok.encode(text, add_special_tokens=True).ids)
            if bos is not None and ids[:2] == [bos, bos]:
                return ids[1:]
            return ids
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        if self.add_bos and bos is not None and ids[:1] != [bos]:
            ids = [int(bos)] + ids
        if self.add_eos and self.eos_token_ids:
            ids = ids + [self.eos_token_ids[0]]
        return ids

    def escape_specials(self, text: str) -> str:
        """`text` with every special token's string replaced by a marker that encode_escaped
        reads as that string's plain text (chat content, before the template renders it)."""
        return self._escaper().escape(text)

    def encode_escaped(self, text: str) -> list[int]:
        """Ids of text that is already rendered with its special tokens (no BOS / EOS added);
        its escaped parts are plain text, whatever special-token strings they hold."""
        return self._escaper().encode(text)

    def _escaper(self) -> SpecialTokenEscape:
        if self._escape is None:
            self._escape = SpecialTokenEscape(self._tok)
        return self._escape

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        try:
            return str(self._tok.decode([i for i in ids if 0 <= i < self.vocab_size],
                                        skip_special_tokens=skip_special_tokens))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:      # a Rust panic inside `tokenizers` is not an Exception
            raise RuntimeError(f"the tokenizer failed to decode {len(ids)} ids: {e}") from None

    def is_shown(self, token_id: int, skip_special_tokens: bool) -> bool:
        """Whether the token reaches the decoder at all (unknown ids and skipped specials don't)."""
        if not 0 <= token_id < self.vocab_size:
            return False
        return not (skip_special_tokens and token_id in self.special_ids)

    def save(self, path: str | Path) -> None:
        """The `tokenizers` tokenizer as a tokenizer.json file (model/tokenizer_export.py)."""
        self._tok.save(str(path))

    def id_to_token(self, token_id: int) -> str | None:
        token: str | None = self._tok.id_to_token(token_id)
        return token

    def byte_fallback_value(self, token_id: int) -> int | None:
        """The byte a <0xNN> token stands for, under a ByteFallback decoder; else None."""
        if not self.has_byte_fallback:
            return None
        if token_id not in self._byte_values:
            s = self._tok.id_to_token(token_id)
            m = _BYTE_TOKEN.fullmatch(s) if s is not None else None
            self._byte_values[token_id] = int(m.group(1), 16) if m else None
        return self._byte_values[token_id]

    # -- bytes for streaming (fast path only) -------------------------------------------------
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
            return str(s).encode()
        if self.kind == "sentencepiece":
            space = "" if first and self._opts["drop_first"] else " "
            return str(s).replace(self._opts["replacement"], space).encode()
        if self.kind == "wordpiece":
            prefix = self._opts["prefix"]
            if not first:
                s = s.replace(prefix, "", 1) if s.startswith(prefix) else " " + s
            if self._opts["cleanup"]:
                for dirty, clean in _WORDPIECE_CLEANUP:
                    s = s.replace(dirty, clean)
            return str(s).encode()
        raise AssertionError(f"no byte table for decoder kind {self.kind!r}")


def _decoder_json(tok: Any) -> dict | None:
    """The tokenizer's decoder as JSON, serialising only the decoder (the whole tokenizer's JSON
    is mostly its vocabulary and merges: half a second to write and parse for 49k tokens)."""
    decoder = tok.decoder
    if decoder is None:
        return None
    try:
        state: dict = json.loads(decoder.__getstate__())
    except Exception:                    # not a serialisable built-in decoder: ask the whole tokenizer
        state = json.loads(tok.to_str()).get("decoder")
    return state


def _token_name(value: Any) -> str | None:
    """tokenizer_config.json names a token as a string or as {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def as_tokenizer(obj: Any) -> TokenizerLike:
    """Wrap what a user has: a pd.Tokenizer (or any TokenizerLike), a `tokenizers.Tokenizer`,
    a transformers fast tokenizer, or a folder holding tokenizer.json. Anything else: TypeError."""
    if isinstance(obj, (str, Path)):
        path = Path(obj)
        if not (path / "tokenizer.json").is_file():
            raise TypeError(f"tokenizer folder {path} holds no tokenizer.json")
        return Tokenizer.from_dir(path)
    if isinstance(obj, TokenizerLike):
        return obj
    from tokenizers import Tokenizer as HFTokenizer
    if isinstance(obj, HFTokenizer):
        return Tokenizer(obj)
    backend = getattr(obj, "backend_tokenizer", None)      # transformers PreTrainedTokenizerFast
    if isinstance(backend, HFTokenizer):
        eos = getattr(obj, "eos_token_id", None)
        return Tokenizer(backend, bos_token_id=getattr(obj, "bos_token_id", None),
                         eos_token_ids=[] if eos is None else [eos])
    raise TypeError(f"cannot use a {type(obj).__module__}.{type(obj).__name__} as a tokenizer: give a "
                    "pd.Tokenizer, a tokenizers.Tokenizer, a transformers fast tokenizer, or a folder "
                    "holding tokenizer.json")
