"""Special-token strings typed in chat content stay text (model/specials.py): escaped content
encodes as the tokenizer would encode it if it had no special tokens, in context; the
template's own special tokens around it are still special; text without any is unchanged."""
import pytest

tokenizers = pytest.importorskip("tokenizers")


def trained():
    """A BPE tokenizer with a lowercasing normalizer and one special matched after normalizing."""
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["hello world <eot> [sep] the end"] * 20,
                            trainers.BpeTrainer(special_tokens=["[UNK]", "<eot>"], vocab_size=80))
    tok.add_special_tokens([AddedToken("[SEP]", normalized=True, special=True)])
    return tok


def as_text(tok, text):
    """What the tokenizer makes of `text` with its special tokens read as text."""
    from tokenizers import Tokenizer
    plain = Tokenizer.from_str(tok.to_str())
    plain.encode_special_tokens = True
    return plain.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("content", ["hello<eot>world", "Hello [SEP] the end", "<eot><eot>", "x\ufdd0\U000f0001y",
                                     "the [sep]<eot>end [SEP]"])
def test_escaped_content_is_text_between_the_templates_specials(content):
    from pagedecode.model.specials import SpecialTokenEscape
    tok = trained()
    esc = SpecialTokenEscape(tok)
    eot, sep = tok.token_to_id("<eot>"), tok.token_to_id("[SEP]")
    ids = esc.encode("<eot>" + esc.escape(content) + "[SEP]")
    assert ids == [eot] + as_text(tok, content) + [sep]
    if any(s in content.lower() for s in ("<eot>", "[sep]")):
        assert ids[1:-1] != tok.encode(content, add_special_tokens=False).ids    # unescaped: real specials


def test_text_without_special_strings_is_unchanged(stories_path):
    from pagedecode.model.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(stories_path)
    text = "<s>Once upon a time, there was a dog.</s> The end"
    assert tok.escape_specials("Once upon a time") == "Once upon a time"
    assert tok.encode_escaped(text) == tok.encode(text, add_special_tokens=False)
    escaped = "<s>" + tok.escape_specials("a</s>b")
    assert tok.decode(tok.encode_escaped(escaped), skip_special_tokens=False) == "<s>a</s>b"
    assert tok.encode_escaped(escaped).count(tok.eos_token_ids[0]) == 0


@pytest.mark.parametrize("source", ["trained", "stories260k", "smollm2"])
def test_the_restoring_copy_shares_the_model_and_encodes_as_the_whole_json_copy(source, request):
    """Built around the tokenizer's own model (~1 ms; the JSON round trip of SmolLM2's 49k tokens
    took ~0.3 s of CPU at every server start), it encodes escaped text exactly as a copy made
    from the whole tokenizer's JSON does."""
    import time

    from pagedecode.model.specials import SpecialTokenEscape
    from pagedecode.model.tokenizer import Tokenizer
    if source == "trained":
        tok = trained()
    elif source == "stories260k":
        tok = Tokenizer.from_dir(request.getfixturevalue("stories_path"))._tok
    else:
        from pagedecode.model.gguf_file import read_metadata
        from pagedecode.model.gguf_tokenizer import build_tokenizer
        tok = build_tokenizer(read_metadata(request.getfixturevalue("smollm2_path")))._tok
    start = time.process_time()
    esc = SpecialTokenEscape(tok)
    took = time.process_time() - start
    whole = esc._restoring_copy_from_json()
    strings = sorted(s for s in esc.markers if s != "\ufdd0")
    content = "Hi " + " and ".join(strings[:8]) + " \ufdd0 [SEP] <eot> 12 café"
    for text in (strings[0] + esc.escape(content) + strings[-1], esc.escape(content), "plain text, 123"):
        assert esc._plain.encode(text, add_special_tokens=False).ids == whole.encode(text, add_special_tokens=False).ids
    assert esc._plain.get_vocab_size() == whole.get_vocab_size()
    assert took < 0.1, took
