"""Incremental detokenizer against the tokenizer's own batch decode, for every decoder kind:
the byte-table fast paths (SentencePiece byte fallback, byte-level BPE, WordPiece, Metaspace)
and the generic window path (bare ByteFallback, Strip / Replace variants, BPEDecoder, CTC,
no decoder, Sequences), with added and special tokens, skip_special_tokens on and off, and
every split of the ids into prompt and output."""
import os

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st
from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models

import pagedecode as pd
from pagedecode.runtime.output.detokenizer import (ByteStream, Utf8TailError, WindowStream,
                                            make_detokenizer)

TEXTS = ["Hello wörld", "naïve café — ünïcode ✓", "日本語のテキスト", "emoji 🎉🚀 mix", "tabs\tand\nnewlines",
         "  leading spaces", "punctuation, it's don't !?", "x", "A  B   C"]


def byte_level_tokenizer():
    from tokenizers import pre_tokenizers, trainers
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|bos|>", "<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXTS * 3, trainer)
    tok.add_tokens(["<added>", "ß€"])
    return pd.Tokenizer(tok, add_bos=True, bos_token_id=tok.token_to_id("<|bos|>"),
                        eos_token_ids=[tok.token_to_id("<|eos|>")])


def wordpiece_tokenizer():
    from tokenizers import normalizers, pre_tokenizers, trainers
    tok = HFTokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[CLS]", "[SEP]"],
                                        show_progress=False)
    tok.train_from_iterator(TEXTS * 3 + ["the cat sat. it's here, isn't it? yes!"], trainer)
    return pd.Tokenizer(tok, add_bos=False)


# A hand-made vocabulary with the pieces every decoder kind cares about: SentencePiece words,
# WordPiece continuations, BPE end-of-word suffixes, CTC's pad and word delimiter, all 256
# byte-fallback tokens; added special and non-special tokens on top.
WORDS = ["▁the", "▁cat", "▁", "▁▁", "a", "b", "ab", "##s", "##ing", "x</w>", "y</w>", "<pad>", "|", " ",
         "'s", ".", "é", "▁é", "\ufffd"]


def sample_vocab_tokenizer(decoder):
    vocab = {"<unk>": 0}
    for w in WORDS:
        vocab[w] = len(vocab)
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok.add_tokens([AddedToken("<ADD>", special=False), AddedToken("▁added", special=False)])
    if decoder is not None:
        tok.decoder = decoder
    return pd.Tokenizer(tok, add_bos=False)


def llama2_decoder(strip=(1, 0)):
    return decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                              decoders.Strip(" ", *strip)])


KINDS = {
    # fast paths (byte tables)
    "llama2": (lambda: sample_vocab_tokenizer(llama2_decoder()), "fast"),
    "llama2-no-strip": (lambda: sample_vocab_tokenizer(decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])), "fast"),
    "metaspace": (lambda: sample_vocab_tokenizer(decoders.Metaspace()), "fast"),
    "metaspace-never": (lambda: sample_vocab_tokenizer(decoders.Metaspace(prepend_scheme="never")), "fast"),
    "wordpiece-sample": (lambda: sample_vocab_tokenizer(decoders.WordPiece()), "fast"),
    "bytelevel-sample": (lambda: sample_vocab_tokenizer(decoders.ByteLevel()), "fast"),
    # the generic window path
    "bytefallback": (lambda: sample_vocab_tokenizer(decoders.ByteFallback()), "window"),
    # (a Strip with stop > 0 is left out: `tokenizers` itself panics on short tokens with it)
    "strip-per-token": (lambda: sample_vocab_tokenizer(decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Strip(" ", 1, 0)])), "window"),
    "strip-2": (lambda: sample_vocab_tokenizer(decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 2, 0)])), "fast"),
    "replace-other": (lambda: sample_vocab_tokenizer(decoders.Sequence(
        [decoders.Replace("a", "AA"), decoders.ByteFallback(), decoders.Fuse()])), "window"),
    "bpe-decoder": (lambda: sample_vocab_tokenizer(decoders.BPEDecoder("</w>")), "window"),
    "ctc": (lambda: sample_vocab_tokenizer(decoders.CTC()), "window"),
    "no-decoder": (lambda: sample_vocab_tokenizer(None), "window"),
    "bytefallback-metaspace": (lambda: sample_vocab_tokenizer(decoders.Sequence(
        [decoders.ByteFallback(), decoders.Metaspace()])), "window"),
}


@pytest.fixture(scope="module")
def kinds():
    return {name: make() for name, (make, _) in KINDS.items()}


@pytest.mark.parametrize("name", sorted(KINDS))
def test_each_kind_takes_its_path(kinds, name):
    tok = kinds[name]
    want = ByteStream if KINDS[name][1] == "fast" else WindowStream
    assert isinstance(make_detokenizer(tok, [1], True), want)


def streams_for(tok):
    """Every implementation that claims to be exact for this tokenizer."""
    out = [lambda p, s: WindowStream(tok, p, s)]
    if tok.byte_pieces is not None:
        out.append(lambda p, s: ByteStream(tok, tok.byte_pieces, p, s))
    return out


def check_every_split(tok, ids, skip):
    """prompt text + stream == the batch decode; where the full decode extends the prompt's own
    decode, the stream is exactly what it adds; text the prompt decoded to and the full decode
    keeps is never sent again."""
    full = tok.decode(ids, skip)
    for make in streams_for(tok):
        for k in range(1, len(ids) + 1):
            d = make(ids[:k], skip)
            out = "".join(d.add(t) for t in ids[k:]) + d.flush("replace")
            assert d.prompt_text + out == full, (k, d.prompt_text, out, full)
            prompt = tok.decode(ids[:k], skip)
            if full.startswith(prompt):
                assert out == full[len(prompt):], (k, prompt, out, full)
            assert d.prompt_text.startswith(os.path.commonprefix([prompt, full])), (k, prompt, d.prompt_text, full)


@pytest.mark.parametrize("name", sorted(KINDS))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans())
def test_stream_equals_batch_decode_for_every_split(kinds, name, data, skip):
    """Random ids (byte tokens, specials, added tokens, invalid UTF-8 included), cut into prompt
    and output at every position: prompt text + stream + flush == the batch decode."""
    tok = kinds[name]
    interesting = [tok._tok.token_to_id(f"<0x{b:02X}>") for b in "é€🐱".encode() + b"\xff\x41\x20\x80\xf0"] + \
        list(range(len(WORDS) + 1)) + list(range(tok.vocab_size - 4, tok.vocab_size))   # words, specials, added
    ids = st.one_of(st.sampled_from(sorted(set(interesting))), st.integers(0, tok.vocab_size - 1))
    check_every_split(tok, data.draw(st.lists(ids, min_size=1, max_size=10)), skip)


@pytest.fixture(scope="module")
def real(stories_path):
    return {"sentencepiece": pd.Tokenizer.from_dir(stories_path), "bytelevel": byte_level_tokenizer(),
            "wordpiece": wordpiece_tokenizer()}


@pytest.mark.parametrize("kind", ["sentencepiece", "bytelevel", "wordpiece"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans())
def test_trained_tokenizers_random_ids(real, kind, data, skip):
    tok = real[kind]
    check_every_split(tok, data.draw(st.lists(st.integers(0, tok.vocab_size - 1), min_size=1, max_size=10)),
                      skip)


def test_a_surrogate_lead_the_output_makes_invalid_at_the_end(real):
    """Byte-level 0xED (the prompt's last byte) then 0xA1 (the output's, the last): Python's
    incremental decoder holds both until the end, then gives two U+FFFDs: one is the prompt's,
    one the output's (both went to the prompt; hypothesis found it)."""
    check_every_split(real["bytelevel"], [171, 96], False)
    check_every_split(real["bytelevel"], [171, 96, 96], False)


@pytest.mark.parametrize("kind", ["sentencepiece", "bytelevel"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=20))
def test_real_text_split_anywhere(real, kind, text):
    """Real text, split into prompt and output at any token, even inside a character: the
    stream never shows half a character or prompt text, and strict flush succeeds."""
    tok = real[kind]
    ids = tok.encode("The " + text)
    full = tok.decode(ids)
    for make in streams_for(tok):
        for cut in range(1, len(ids) + 1):
            d = make(ids[:cut], True)
            pieces = [d.add(t) for t in ids[cut:]] + [d.flush("strict")]
            assert "\ufffd" not in "".join(pieces)
            assert d.prompt_text + "".join(pieces) == full


def test_prompt_ending_in_a_complete_byte_run_is_not_repeated(real):
    """Reproduction: stories260k, prompt "The cat 🐱🐶": the emoji run is the prompt's, so the
    output starts after it (it used to start with the emoji again)."""
    tok = real["sentencepiece"]
    prompt = tok.encode("The cat 🐱🐶")
    out = tok.encode(". She", add_special_tokens=False)
    for make in streams_for(tok):
        d = make(prompt, True)
        assert d.prompt_text == "The cat 🐱🐶"
        assert "".join(d.add(t) for t in out) + d.flush() == tok.decode(prompt + out)[len("The cat 🐱🐶"):]


def test_byte_level_prompt_ending_inside_a_character(real):
    """Reproduction: a byte-level prompt whose last token ends inside "é": the output's first
    text is the whole character, never U+FFFD."""
    tok = real["bytelevel"]
    alphabet = {b: c for c, b in pd.model.tokenizer.byte_alphabet().items()}
    first, second = (tok._tok.token_to_id(alphabet[b]) for b in "é".encode())
    prompt = tok.encode("caf", add_special_tokens=False) + [first]
    for make in streams_for(tok):
        d = make(prompt, True)
        assert d.prompt_text == "caf"
        assert d.add(second) == "é"
        assert d.flush() == ""


def test_sentencepiece_leading_space_and_byte_fallback(real):
    tok = real["sentencepiece"]

    def stream(prompt, output, skip=True, errors="replace"):
        d = make_detokenizer(tok, prompt, skip)
        return "".join(d.add(t) for t in output) + d.flush(errors)
    assert stream([1, 403, 407, 261, 378], [432, 383]) == ", there"
    assert stream([1], [403, 407]) == "Once upon"           # the first shown token loses its space
    assert stream([1], [1, 403], skip=False) == "<s> Once"   # a shown special stops the strip
    euro = [3 + b for b in "€".encode()]                       # <0xE2> <0x82> <0xAC>
    d = make_detokenizer(tok, [1, 403], True)
    assert [d.add(t) for t in euro] == ["", "", ""]          # a run is held ...
    assert d.add(403) == "€ Once"                              # ... until a normal token closes it
    for make in streams_for(tok):
        d = make([1, 403], True)
        for t in euro[:2]:
            d.add(t)
        with pytest.raises(Utf8TailError):
            d.flush("strict")
    assert stream([1, 403], euro[:2], errors="replace") == "\ufffd\ufffd"


def test_ids_beyond_vocabulary_add_nothing(real, kinds):
    for tok in list(real.values()) + list(kinds.values()):
        for make in streams_for(tok):
            d = make(tok.encode("a"), True)
            assert d.add(tok.vocab_size + 5) + d.add(10**9) + d.flush() == ""


def test_window_slides_and_stays_exact(kinds):
    tok = kinds["ctc"]
    ids = [tok._tok.token_to_id(w) for w in ("a", "b", "a", "a", "|", "<pad>", "b")] * 40
    check_every_split(tok, ids[:300], True)


# -- invalid bytes, and where the prompt's text ends ---------------------------------------------

INVALID = [b"\xff", b"\x80", b"\xf0\x41", b"\xf0\xf0\xf0", b"\xc3\xa9\xff", b"\xffA\xe2\x82\xac",
           b"\xe2\x82\xf0\x9f\x90\xb1\x80"]


@pytest.mark.parametrize("data", INVALID, ids=lambda b: b.hex())
def test_byte_fallback_output_ending_in_invalid_bytes_is_replacement_characters(real, kinds, data):
    """Reproduction: an output ending in bytes that can never complete a character failed
    ("output ends inside a UTF-8 character"); it is U+FFFD, as the tokenizer's decode says,
    shown as soon as it is known invalid (a run that cannot be valid UTF-8 any more)."""
    for tok in (real["sentencepiece"], kinds["bytefallback"], kinds["llama2"]):
        prompt = tok.encode("Once", add_special_tokens=False)
        out = [tok._tok.token_to_id(f"<0x{b:02X}>") for b in data]
        want = tok.decode(prompt + out)[len(tok.decode(prompt)):]
        assert want.count("\ufffd") >= 1
        for make in streams_for(tok):
            d = make(prompt, True)
            pieces = [d.add(t) for t in out]
            assert "".join(pieces) + d.flush("strict") == want
            known = next(i for i in range(1, len(data) + 1)       # the first byte that spoils the run
                         if not pd.runtime.output.utf8.valid_prefix(data[:i]))
            assert "".join(pieces[:known]) == "\ufffd" * known


@pytest.mark.parametrize("data", [b"\xf0\x9f", b"\xc3\xa9\xe2\x82", b"\xe2"], ids=lambda b: b.hex())
def test_output_ending_inside_a_valid_character_still_fails(real, kinds, data):
    for tok in (real["sentencepiece"], kinds["bytefallback"]):
        prompt = tok.encode("Once", add_special_tokens=False)
        out = [tok._tok.token_to_id(f"<0x{b:02X}>") for b in data]
        for make in streams_for(tok):
            d = make(prompt, True)
            assert [d.add(t) for t in out] == [""] * len(out)       # held: it may still be valid
            with pytest.raises(Utf8TailError, match="output ends inside a UTF-8 character"):
                d.flush("strict")
            d = make(prompt, True)
            assert "".join(d.add(t) for t in out) + d.flush("replace") == "\ufffd" * len(data)


@settings(max_examples=200, deadline=None)
@given(prompt=st.binary(min_size=0, max_size=6), output=st.binary(min_size=0, max_size=8))
@example(prompt=b"\xed\xa0", output=b"\x00")     # the prompt's held ED A0 is two U+FFFDs, both the prompt's
def test_plain_bytes_stream_like_python_replace(prompt, output):
    """One token per byte (pd.testing.ByteVocabTokenizer): each maximal invalid subpart is U+FFFD
    as soon as it is known invalid, the stream is what the decode adds after the prompt's, and a
    strict flush fails exactly when the output's bytes end inside a valid but unfinished character."""
    import codecs
    tok = pd.testing.ByteVocabTokenizer({b + 1: bytes([b]) for b in range(256)})
    ids = [b + 1 for b in prompt + output]
    full = (prompt + output).decode("utf-8", "replace")
    dec = codecs.getincrementaldecoder("utf-8")("replace")
    dec.decode(prompt + output)
    unfinished = bool(output) and bool(dec.getstate()[0])
    d = make_detokenizer(tok, ids[:len(prompt)], True)
    streamed = "".join(d.add(t) for t in ids[len(prompt):])
    if unfinished:
        with pytest.raises(Utf8TailError):
            d.flush("strict")
        streamed += d.flush("replace")
    else:
        streamed += d.flush("strict")
    assert d.prompt_text + streamed == full
    prompt_text = prompt.decode("utf-8", "replace")
    if full.startswith(prompt_text):
        assert streamed == full[len(prompt_text):]


def test_prompt_byte_run_is_not_streamed_again_by_a_bare_byte_fallback_decoder(kinds):
    """Reproduction: a bare ByteFallback decoder, prompt <0x20>, output <0x20><0xC3><0xA9>:
    the stream was "  é", the prompt's space again. It is " é"."""
    tok = kinds["bytefallback"]
    byte = {b: tok._tok.token_to_id(f"<0x{b:02X}>") for b in (0x20, 0xC3, 0xA9)}
    for make in streams_for(tok):
        d = make([byte[0x20]], True)
        out = "".join(d.add(byte[b]) for b in (0x20, 0xC3, 0xA9)) + d.flush()
        assert out == " é"
        assert d.prompt_text == " "


def test_a_bare_byte_fallback_run_is_held_whole_because_a_later_byte_can_void_it(kinds):
    """Why the stream of prompt <0x20>, output <0x20><0xC3><0xA9> sends " é" at the third token
    and not " " at the first (the minimal hold-back asked for): a bare ByteFallback decoder
    decodes a run of byte tokens as one unit, and a run that does not end as valid UTF-8 becomes
    one U+FFFD per byte, the space included. Output <0x20><0xC3> then a plain token decodes to
    U+FFFD U+FFFD + the token's text: a space sent early would contradict the full decode."""
    tok = kinds["bytefallback"]
    byte = {b: tok._tok.token_to_id(f"<0x{b:02X}>") for b in (0x20, 0xC3)}
    plain = next(i for i in range(tok.vocab_size) if tok.byte_fallback_value(i) is None and
                 tok.decode([i]).isalpha())
    word = tok.decode([plain])
    full = tok.decode([byte[0x20], byte[0x20], byte[0xC3], plain])
    assert full == "\ufffd" * 3 + word          # the output's space is voided with the run
    for make in streams_for(tok):
        d = make([byte[0x20]], True)
        assert d.add(byte[0x20]) == ""           # held: the run may still be voided
        out = d.add(byte[0xC3]) + d.add(plain) + d.flush()
        assert d.prompt_text + out == full


def test_byte_level_prompt_ending_inside_a_character_then_a_new_one(real):
    """Reproduction: a byte-level prompt whose last token ends inside a character, then an output
    that starts a new one: the output started with U+FFFD. The U+FFFD is the prompt's (its
    character never completed); the output is what the full decode adds: "A" (vLLM's too)."""
    tok = real["bytelevel"]
    alphabet = {b: c for c, b in pd.model.tokenizer.byte_alphabet().items()}
    first = tok._tok.token_to_id(alphabet["é".encode()[0]])
    prompt = tok.encode("caf", add_special_tokens=False) + [first]
    for output in ("A", "é", " x"):
        out = tok.encode(output, add_special_tokens=False)
        assert tok.decode(prompt + out) == "caf\ufffd" + output
        for make in streams_for(tok):
            d = make(prompt, True)
            assert "".join(d.add(t) for t in out) + d.flush() == output
            assert d.prompt_text == "caf\ufffd"
        d = make_detokenizer(tok, prompt, True)
        assert d.flush("strict") == "" and d.prompt_text == "caf\ufffd"    # no output: nothing unfinished


@pytest.mark.parametrize("data", [b"\xff", b"\x80", b"\xf0\x41", b"\xf0\xf0\xf0"], ids=lambda b: b.hex())
def test_engine_output_ending_in_invalid_bytes_finishes(real, data):
    """The engine over the real stories260k tokenizer (SentencePiece byte fallback): an output
    whose last bytes can never complete a character FINISHES with U+FFFD, its text the batch
    decode's, streamed as soon as known invalid; one ending inside a valid character still fails."""
    from pagedecode.testing import ScriptedModel
    tok = real["sentencepiece"]
    out = [3 + b for b in data]                            # <0xNN> is id 3 + NN
    prompt = tok.encode("Once upon a time")
    eng = pd.Engine(ScriptedModel(out, vocab_size=tok.vocab_size), tok, pd.EngineConfig(max_cache_tokens=256))
    rid = eng.add_request(prompt, pd.SamplingParams(max_tokens=len(out)))
    events = []
    while eng.has_unfinished():
        events += eng.step()
    result = eng.result(rid)
    assert result.state == pd.RequestState.FINISHED and result.error is None
    assert result.text == tok.decode(prompt + out)[len(tok.decode(prompt)):] == "\ufffd" * len(data)
    deltas = [e for e in events if isinstance(e, pd.DeltaEvent)]
    assert "".join(e.text for e in deltas) == result.text
    eng = pd.Engine(ScriptedModel([3 + 0xF0, 3 + 0x9F], vocab_size=tok.vocab_size), tok,
                    pd.EngineConfig(max_cache_tokens=256))
    failed = eng.generate([prompt], pd.SamplingParams(max_tokens=2))[0]
    assert failed.state == pd.RequestState.FAILED and "output ends inside a UTF-8 character" in failed.error


def test_engine_text_after_a_prompt_with_an_open_tail(kinds, real):
    """(b) and (c) through the engine: a bare ByteFallback decoder (the window path) and a
    byte-level BPE (the byte table), each with a prompt whose text the output could revisit."""
    from pagedecode.testing import ScriptedModel
    tok = kinds["bytefallback"]
    byte = {b: tok._tok.token_to_id(f"<0x{b:02X}>") for b in (0x20, 0xC3, 0xA9)}
    eng = pd.Engine(ScriptedModel([byte[0x20], byte[0xC3], byte[0xA9]], vocab_size=tok.vocab_size), tok,
                    pd.EngineConfig(max_cache_tokens=256))
    assert eng.generate([[byte[0x20]]], pd.SamplingParams(max_tokens=3))[0].text == " é"
    tok = real["bytelevel"]
    alphabet = {b: c for c, b in pd.model.tokenizer.byte_alphabet().items()}
    prompt = tok.encode("caf", add_special_tokens=False) + [tok._tok.token_to_id(alphabet[0xC3])]
    out = tok.encode("A cat", add_special_tokens=False)
    eng = pd.Engine(ScriptedModel(out, vocab_size=tok.vocab_size), tok, pd.EngineConfig(max_cache_tokens=256))
    assert eng.generate([prompt], pd.SamplingParams(max_tokens=len(out)))[0].text == "A cat"


def test_a_byte_run_that_turns_invalid_after_a_window_start_takes_its_leading_space(kinds):
    """Hypothesis found it: "<unk>", then bytes 20 C2 80 20 C3 80 as the prompt (valid: " \\x80 À"),
    then 80. The whole run is U+FFFD per byte, its space too; a window that started at the run's
    first byte had lost that space to the Strip decoder and kept it in the prompt's text."""
    tok = kinds["llama2"]
    ids = [0] + [tok._tok.token_to_id(f"<0x{b:02X}>") for b in (0x20, 0xC2, 0x80, 0x20, 0xC3, 0x80, 0x80)]
    assert tok.decode(ids, False) == "<unk>" + "\ufffd" * 7
    check_every_split(tok, ids, False)
