"""Incremental detokenizer against the tokenizer's own batch decode, for the three families the
loader accepts: SentencePiece-style byte fallback (stories260k), byte-level BPE, WordPiece."""
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import pagedecode as pd
from pagedecode.runtime.detokenizer import IncrementalDetokenizer, Utf8TailError

TEXTS = ["Hello wörld", "naïve café — ünïcode ✓", "日本語のテキスト", "emoji 🎉🚀 mix", "tabs\tand\nnewlines",
         "  leading spaces", "punctuation, it's don't !?", "x", "A  B   C"]


def byte_level_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|bos|>", "<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXTS * 3, trainer)
    tok.add_tokens(["<added>", "ß€"])
    return pd.Tokenizer(tok, add_bos=True, bos_token_id=tok.token_to_id("<|bos|>"),
                        eos_token_ids=[tok.token_to_id("<|eos|>")])


def wordpiece_tokenizer():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[CLS]", "[SEP]"],
                                        show_progress=False)
    tok.train_from_iterator(TEXTS * 3 + ["the cat sat. it's here, isn't it? yes!"], trainer)
    return pd.Tokenizer(tok, add_bos=False)


@pytest.fixture(scope="module")
def tokenizers(stories_path):
    return {"sentencepiece": pd.Tokenizer.from_dir(stories_path), "bytelevel": byte_level_tokenizer(),
            "wordpiece": wordpiece_tokenizer()}


def stream(tok, prompt, output, skip=True, errors="replace"):
    d = IncrementalDetokenizer(tok, prompt, skip)
    return "".join(d.add(t) for t in output) + d.flush(errors)


def open_tail(tok, ids, skip):
    """The prompt leaves something for the output to finish: an open byte run or half a char."""
    shown = [t for t in ids if tok.is_shown(t, skip)]
    if not shown:
        return False
    if getattr(tok, "byte_fallback_value", lambda t: None)(shown[-1]) is not None:
        return True
    return tok.decode(ids, skip).endswith("\ufffd")


@pytest.mark.parametrize("kind", ["sentencepiece", "bytelevel", "wordpiece"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans())
def test_stream_equals_batch_decode(tokenizers, kind, data, skip):
    """Random ids (byte tokens, specials, invalid UTF-8 included): prompt text + stream + flush
    is exactly the tokenizer's batch decode of prompt + output."""
    tok = tokenizers[kind]
    ids = st.integers(0, tok.vocab_size - 1)
    prompt = data.draw(st.lists(ids, min_size=1, max_size=6))
    output = data.draw(st.lists(ids, max_size=12))
    if open_tail(tok, prompt, skip):            # a prompt ending mid-character: tested below
        prompt = prompt + tok.encode("a")[-1:]
    prompt_text = tok.decode(prompt, skip)
    full = tok.decode(prompt + output, skip)
    assert full.startswith(prompt_text)
    assert stream(tok, prompt, output, skip) == full[len(prompt_text):]


@pytest.mark.parametrize("kind", ["sentencepiece", "bytelevel"])
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=20),
       cut=st.integers(1, 40))
def test_real_text_split_anywhere(tokenizers, kind, text, cut):
    """Real text, split into prompt and output at any token, even inside a character: the
    stream holds the rest of the text exactly, never half a character and never prompt text
    (a character straddling the cut belongs to the output)."""
    tok = tokenizers[kind]
    ids = tok.encode("The " + text)
    cut = min(cut, len(ids))
    prompt, output = ids[:cut], ids[cut:]
    d = IncrementalDetokenizer(tok, prompt, True)
    pieces = [d.add(t) for t in output] + [d.flush("strict")]
    streamed = "".join(pieces)
    full = tok.decode(ids)
    assert "\ufffd" not in streamed
    assert full.endswith(streamed)
    not_streamed = full[:len(full) - len(streamed)]
    assert tok.decode(prompt).startswith(not_streamed)
    assert not_streamed == tok.decode(prompt) or open_tail(tok, prompt, True)


def test_sentencepiece_leading_space_and_byte_fallback(tokenizers):
    tok = tokenizers["sentencepiece"]
    assert stream(tok, [1, 403, 407, 261, 378], [432, 383]) == ", there"
    assert stream(tok, [1], [403, 407]) == "Once upon"           # the first shown token loses its space
    assert stream(tok, [1], [1, 403], skip=False) == "<s> Once"   # a shown special stops the strip
    euro = [3 + b for b in "€".encode()]                            # <0xE2> <0x82> <0xAC>
    d = IncrementalDetokenizer(tok, [1, 403], True)
    assert [d.add(t) for t in euro] == ["", "", ""]               # a run is held ...
    assert d.add(403) == "€ Once"                                   # ... until a normal token closes it
    d = IncrementalDetokenizer(tok, [1, 403], True)
    for t in euro[:2]:
        d.add(t)
    with pytest.raises(Utf8TailError):
        d.flush("strict")
    assert stream(tok, [1, 403], euro[:2], skip=True, errors="replace") == "\ufffd\ufffd" == \
        tok.decode([1, 403] + euro[:2])[len(" Once") - 1:]


def test_ids_beyond_vocabulary_add_nothing(tokenizers):
    for tok in tokenizers.values():
        assert stream(tok, tok.encode("a"), [tok.vocab_size + 5, 10**9]) == ""
