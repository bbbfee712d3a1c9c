"""Special-token strings typed as text stay text.

A chat template renders the messages between its own special tokens (`<s>`, `<|im_start|>`).
Encoded as one string, a message that types `</s><s>` would get the real EOS and BOS ids: a
client could end a turn or open one as someone else. So, before rendering, each special token's
string in a message becomes a marker: a Unicode noncharacter (U+FDD0, kept for a program's
internal use) and a private-use character, neither of which any template or tokenizer makes a
token of. The template renders around the markers; a copy of the tokenizer whose normalizer
first turns each marker back into its string encodes the whole text in one pass. The tokenizer
finds special tokens in the raw text before it normalizes, so the template's own are found and
the content's are read as text, in context, as if the tokenizer had no such special token.

A message holding U+FDD0 itself gets it back the same way (its own marker, restored last).
"""
from __future__ import annotations

import json
import re
from typing import Any

MARK = "\ufdd0"
_FIRST_SLOT = 0xF0000          # Supplementary Private Use Area-A: 65,534 markers


class SpecialTokenEscape:
    """escape(text): the text with special-token strings replaced by markers; encode(text): the
    ids of rendered text, markers read as the strings they stand for."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        strings = {t.content for t in tok.get_added_tokens_decoder().values() if t.special and t.content}
        self.markers = {s: MARK + chr(_FIRST_SLOT + 1 + i) for i, s in enumerate(sorted(strings))}
        self.markers[MARK] = MARK + chr(_FIRST_SLOT)
        # the longest string first: at one position the tokenizer also takes the longest match
        self._pattern = re.compile("|".join(re.escape(s) for s in sorted(self.markers, key=len, reverse=True)))
        self._plain = self._restoring_copy()

    def escape(self, text: str) -> str:
        return self._pattern.sub(lambda m: self.markers[m.group()], text)

    def encode(self, text: str) -> list[int]:
        """Ids of `text` (no BOS / EOS added); text without markers is encoded as it is."""
        if MARK not in text:
            return list(self._tok.encode(text, add_special_tokens=False).ids)
        return list(self._plain.encode(text, add_special_tokens=False).ids)

    def _restoring_copy(self) -> Any:
        """The tokenizer with a normalizer that restores the markers first. Its special tokens
        are all matched before normalizing (`normalized: false`, as they nearly always are), so
        a restored string is never matched as one.

        Built around the same model object (read only, shared: no copy of the vocabulary and
        merges) with the same added tokens, in id order; where that does not give every added
        token its id, from the whole tokenizer's JSON (~0.3 s of CPU for 49k tokens, at start)."""
        from tokenizers import AddedToken, Tokenizer as HFTokenizer, normalizers
        tok = self._tok
        copy = HFTokenizer(tok.model)
        for part in ("pre_tokenizer", "post_processor", "decoder"):
            if getattr(tok, part) is not None:
                setattr(copy, part, getattr(tok, part))
        restore = [normalizers.Replace(m, s) for s, m in self.markers.items() if s != MARK]
        restore.append(normalizers.Replace(self.markers[MARK], MARK))
        copy.normalizer = normalizers.Sequence(restore + ([tok.normalizer] if tok.normalizer is not None else []))
        added = sorted(tok.get_added_tokens_decoder().items())
        for _, t in added:
            token = AddedToken(t.content, single_word=t.single_word, lstrip=t.lstrip, rstrip=t.rstrip,
                               normalized=t.normalized and not t.special, special=t.special)
            if t.special:
                copy.add_special_tokens([token])
            else:
                copy.add_tokens([token])
        same = [(i, t.content) for i, t in sorted(copy.get_added_tokens_decoder().items())] == \
            [(i, t.content) for i, t in added]
        if same and tok.truncation is None and tok.padding is None:
            return copy
        return self._restoring_copy_from_json()

    def _restoring_copy_from_json(self) -> Any:
        from tokenizers import Tokenizer as HFTokenizer
        spec = json.loads(self._tok.to_str())
        for t in spec.get("added_tokens", []):
            if t.get("special"):
                t["normalized"] = False
        restore = [{"type": "Replace", "pattern": {"String": m}, "content": s}
                   for s, m in self.markers.items() if s != MARK]
        restore.append({"type": "Replace", "pattern": {"String": self.markers[MARK]}, "content": MARK})
        if spec.get("normalizer") is not None:
            restore.append(spec["normalizer"])
        spec["normalizer"] = {"type": "Sequence", "normalizers": restore}
        return HFTokenizer.from_str(json.dumps(spec))
