"""A `tokenizers` tokenizer rebuilt from a GGUF's metadata (tokenizer.ggml.*).

Two models, as llama.cpp names them in `tokenizer.ggml.model`:

- "llama" (SentencePiece): llama.cpp merges the adjacent pair whose merged piece scores best,
  which is BPE with the merges ranked by the merged piece's score. The file seldom lists merges,
  so they are derived: every way of cutting a normal piece into two pieces of the vocabulary.
  Byte fallback (<0xNN> pieces), a "▁" prepended to the first word (unless add_space_prefix is
  false) and the Llama 2 decoder: ▁ -> space, byte fallback, fuse, strip that one space.
- "gpt2" (byte-level BPE): the vocabulary and merges as stored, the split regex that
  `tokenizer.ggml.pre` names (GPT-2's when it names none we know), the ByteLevel decoder.

Control (and unknown) tokens become special added tokens, user-defined ones plain added tokens,
as llama.cpp matches both whole. BOS / EOS and add_bos_token / add_eos_token go to pd.Tokenizer.
"""
from __future__ import annotations

from typing import Any, Mapping

from ..errors import ModelLoadError
from .config import NO_TOKEN
from .tokenizer import Tokenizer

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the regex that splits text before byte-level BPE
SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
          "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
# pre types whose BPE takes a whole word that is in the vocabulary before merging (Llama 3)
IGNORE_MERGES = ("llama-bpe", "llama3", "llama-v3")


def _token_id(meta: Mapping[str, Any], key: str) -> int | None:
    value = meta.get(f"tokenizer.ggml.{key}")
    return None if value is None or int(value) == NO_TOKEN else int(value)


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Merges for a SentencePiece vocabulary: each normal piece cut in two known pieces, best
    score first (ties: lower id first), as llama.cpp's tokenizer prefers them.

    Only cuts whose two sides have lengths some piece has are tried: a piece of n characters
    costs at most min(n, distinct lengths) lookups, so the Python work is linear in the
    vocabulary's characters (trying every cut made one long piece quadratic)."""
    ids = {t: i for i, t in reversed(list(enumerate(tokens)))}
    lengths = sorted({len(t) for t in ids})
    known = set(lengths)
    ranked = []
    for i, piece in enumerate(tokens):
        n = len(piece)
        if types[i] != NORMAL or n < 2:
            continue
        for cut in lengths:
            if cut >= n:
                break
            if n - cut not in known:
                continue
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[i], i, ids[left], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _list(meta: Mapping[str, Any], key: str) -> list[Any] | None:
    """An array of the metadata as a list (numeric arrays are read as numpy arrays); None if absent."""
    value = meta.get(f"tokenizer.ggml.{key}")
    if value is None:
        return None
    return value.tolist() if hasattr(value, "tolist") else list(value)


def build_tokenizer(meta: Mapping[str, Any]) -> Tokenizer:
    """pd.Tokenizer from a GGUF's metadata; ModelLoadError for a tokenizer model it cannot build."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTokenizer
    model = meta.get("tokenizer.ggml.model")
    tokens = [str(t) for t in _list(meta, "tokens") or []]
    if not tokens:
        raise ModelLoadError("the GGUF holds no tokenizer (tokenizer.ggml.tokens); pass tokenizer=DIR")
    types = _list(meta, "token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ModelLoadError(f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    vocab = dict(zip(reversed(tokens), range(len(tokens) - 1, -1, -1)))     # a repeated token: its first id
    stored = _list(meta, "merges")
    merges = [tuple(m.split(" ", 1)) for m in stored] if stored else None
    unk = _token_id(meta, "unknown_token_id")
    if model == "llama":
        scores = [float(s) for s in _list(meta, "scores") or [0.0] * len(tokens)]
        if len(scores) != len(tokens):
            raise ModelLoadError(f"tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
        bpe = models.BPE(vocab=vocab, merges=merges or spm_merges(tokens, scores, types),
                         unk_token=tokens[unk] if unk is not None else None, fuse_unk=True, byte_fallback=True)
        tok = HFTokenizer(bpe)
        space = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if space else "never",
                                                     split=False)
        parts = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence(parts + ([decoders.Strip(" ", 1, 0)] if space else []))
        default_bos = True           # llama.cpp adds BOS to a SentencePiece vocabulary unless told not to
    elif model == "gpt2":
        if merges is None:
            raise ModelLoadError("a gpt2 (byte-level BPE) GGUF tokenizer without tokenizer.ggml.merges")
        pre = meta.get("tokenizer.ggml.pre")
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in IGNORE_MERGES))
        if pre in SPLITS:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        elif pre == "smollm":
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                         pre_tokenizers.ByteLevel(add_prefix_space=False)])
        else:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        default_bos = False
    else:
        raise ModelLoadError(f"unsupported GGUF tokenizer model {model!r} (supported: llama, gpt2); "
                             "pass tokenizer=DIR holding a tokenizer.json")
    special = [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types) if k in (CONTROL, UNKNOWN)]
    tok.add_special_tokens(special)
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types) if k == USER_DEFINED])
    bos, eos = _token_id(meta, "bos_token_id"), _token_id(meta, "eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_bos)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:       # so that the bare `tokenizers` object encodes as pd.Tokenizer does
        assert bos is not None or not add_bos
        single = ([f"{tokens[bos]}:0"] if add_bos and bos is not None else []) + ["$A:0"] + \
                 ([f"{tokens[eos]}:0"] if add_eos and eos is not None else [])
        named = [(tokens[i], i) for i, on in ((bos, add_bos), (eos, add_eos)) if on and i is not None]
        tok.post_processor = processors.TemplateProcessing(single=" ".join(single), special_tokens=named)
    eos_ids = [i for i in (eos, _token_id(meta, "eot_token_id"), _token_id(meta, "eom_token_id")) if i is not None]
    # the vocabulary's longest string in bytes, from the list in hand (asking `tokenizers` for its
    # vocabulary builds a 49k-entry dict: ~0.1 s of the first request)
    longest = max(map(len, map(str.encode, tokens)))
    return Tokenizer(tok, add_bos=add_bos, add_eos=add_eos, bos_token_id=bos, eos_token_ids=dict.fromkeys(eos_ids),
                     max_token_bytes=longest)
