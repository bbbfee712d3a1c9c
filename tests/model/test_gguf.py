"""GGUF files: stories260K.gguf (llama.cpp's own file) against REFERENCE.md and the safetensors
checkpoint; written files of every tensor type against the float weights they hold; the
tokenizer rebuilt from metadata against tokenizer.json."""
import random

import numpy as np

import pytest
import torch

import pagedecode as pd
from pagedecode import cli
from pagedecode.errors import ModelLoadError
from pagedecode.model.config import ModelConfig
from pagedecode.model.llama import LlamaModel
from pagedecode.model.quant import QuantizedWeight
from pagedecode.model.tokenizer import Tokenizer
from pagedecode.testing import prefill_batch

from .gguf_files import Q, bytelevel_tokenizer_meta, gguf, random_llama, write_gguf
from .test_stories260k import BOS_ONLY_FIRST_60, REFERENCE, TOP5

PIECES = ["Once upon a time", " there", "Lily", "  ", "\n", "\n\n", "\t", "😀", "👩‍👩‍👧", "日本語", "中文字符",
          "한국어", "é", "ï", "naïve", "ß", "<s>", "</s>", "<unk>", "<0x0A>", "▁", "12345", "3.14", "!?", "'s", "…",
          "\r\n", " ", "don't", "The cat sat.", "Ünïcödé", "a  b", "   ", "x"]


def sample_strings(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = list(PIECES)
    while len(out) < n:
        out.append("".join(rng.choice(PIECES) for _ in range(rng.randint(1, 6))))
    return out


def logits_of(model, ids):
    c = model.config
    kv = pd.KVCache(c.num_layers, 4, 16, c.num_kv_heads, c.head_dim, model.dtype)
    return model.forward(prefill_batch(ids, pages=[0, 1, 2, 3], page_size=16, all_logits=True), kv)


@pytest.fixture(scope="module")
def stories_gguf(stories_path):
    path = stories_path / "source" / "stories260K.gguf"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    return path


@pytest.fixture(scope="module")
def gguf_engine(stories_gguf):
    return pd.Engine.from_pretrained(stories_gguf)


def test_stories_gguf_hyperparameters(gguf_engine, stories_path):
    c, ref = gguf_engine.model.config, pd.Engine.from_pretrained(stories_path).model.config
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "rms_norm_eps", "rope_theta", "bos_token_id", "eos_token_ids", "qk_norm"):
        assert getattr(c, field) == getattr(ref, field), field
    assert c.max_position_embeddings == 2048          # as the file states (llama2.c trained with 512)
    assert gguf_engine.model.uses_cpu_extension() == pd.Engine.from_pretrained(stories_path).model.uses_cpu_extension()


@pytest.mark.parametrize("prompt", list(REFERENCE))
def test_stories_gguf_greedy_matches_reference(gguf_engine, prompt):
    ids, new, text = REFERENCE[prompt]
    out = gguf_engine.generate(prompt, pd.SamplingParams(max_tokens=32))[0]
    assert out.prompt_token_ids == ids
    assert out.token_ids == new
    assert out.text == text


def test_stories_gguf_from_bos_and_against_safetensors(gguf_engine, stories_path):
    out = gguf_engine.generate([[1]], pd.SamplingParams(max_tokens=60))[0]
    assert out.token_ids == BOS_ONLY_FIRST_60
    ref, gg = pd.Engine.from_pretrained(stories_path), gguf_engine
    prompts = ["Tom had a big red ball and a small blue car. He", "Sue 😀\n日本"]
    a = ref.generate(prompts, pd.SamplingParams(max_tokens=40))
    b = gg.generate(prompts, pd.SamplingParams(max_tokens=40))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.text for o in a] == [o.text for o in b]
    for prompt, top in TOP5.items():
        ids = REFERENCE[prompt][0]
        la, lb = logits_of(ref.model, ids), logits_of(gg.model, ids)
        torch.testing.assert_close(lb, la, atol=1e-4, rtol=0)
        assert lb[-1].topk(5).indices.tolist() == [t for t, _ in top]


def test_stories_gguf_tokenizer_matches_tokenizer_json(gguf_engine, stories_path):
    ref = Tokenizer.from_dir(stories_path)
    tok = gguf_engine.tokenizer
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_ids, tok.special_ids, tok.kind) == \
        (ref.vocab_size, ref.bos_token_id, ref.eos_token_ids, ref.special_ids, ref.kind)
    for s in sample_strings(300):
        ids = ref.encode(s)
        assert tok.encode(s) == ids, s
        assert tok.encode(s, add_special_tokens=False) == ref.encode(s, add_special_tokens=False), s
        assert tok.decode(ids) == ref.decode(ids), s
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False), s
    rng = random.Random(1)
    for _ in range(100):                      # any id sequence decodes alike, byte runs included
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 12))]
        assert tok.decode(ids) == ref.decode(ids)
        assert [tok.token_bytes(i, f) for i in ids for f in (True, False)] == \
            [ref.token_bytes(i, f) for i in ids for f in (True, False)]


def test_stories_gguf_with_tokenizer_dir(stories_gguf, stories_path):
    engine = pd.Engine.from_pretrained(stories_gguf, tokenizer=stories_path)
    out = engine.generate("Once upon a time", pd.SamplingParams(max_tokens=16))[0]
    assert out.text == REFERENCE["Once upon a time"][2][:len(out.text)] and len(out.token_ids) == 16


def test_cli_generate_on_a_gguf_file(stories_gguf, capsys):
    assert cli.main(["generate", "--model", str(stories_gguf), "--prompt", "Once upon a time",
                     "--max-tokens", "16"]) == 0
    assert capsys.readouterr().out.strip() == ", there was a little girl named Lily. She loved to play"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from pagedecode.model.default_model import BOS, EOS, default_model_path
    cfg, weights = random_llama(seed=3)
    meta = bytelevel_tokenizer_meta(default_model_path() / "tokenizer.json", BOS, EOS)
    return tmp_path_factory.mktemp("gguf"), cfg, weights, meta


BLOCK_QTYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, *BLOCK_QTYPES], ids=lambda q: q.name)
def test_written_gguf_of_each_type_runs_its_values(tiny, qtype):
    """The loaded model computes with exactly the values the file holds (dequantized by gguf),
    q/k rows unpermuted: logits against a float model built from those values. Every block type
    stays in its blocks, in every role (embedding and head too), at the file's size."""
    folder, cfg, weights, meta = tiny
    path = folder / f"tiny-{qtype.name}.gguf"
    expected = write_gguf(path, cfg, weights, meta, qtype=qtype)
    engine = pd.Engine.from_pretrained(path, attention_backend="torch")
    model = engine.model
    native = qtype in BLOCK_QTYPES
    assert isinstance(model.layers[0].qkv_w, QuantizedWeight) == native
    if native:
        assert {w.kind for w in model._weights() if isinstance(w, QuantizedWeight)} == {qtype.name.lower()}
    assert isinstance(model.embed, QuantizedWeight) == native and isinstance(model.lm_head, QuantizedWeight) == native
    config = ModelConfig.from_hf(cfg)
    ref = LlamaModel(config, expected, attention_backend="torch")
    ids = list(range(5, 45))
    torch.testing.assert_close(logits_of(model, ids), logits_of(ref, ids), atol=2e-4, rtol=1e-4)
    if native:
        float_bytes = sum(t.numel() * 4 for n, t in weights.items())
        assert engine.weight_bytes < float_bytes * (0.3 if qtype == Q.Q8_0 else 0.21)     # no float copy
        reader = gguf.GGUFReader(str(path))
        assert engine.weight_bytes == sum(int(t.n_bytes) for t in reader.tensors)


def test_written_gguf_bytelevel_tokenizer_matches_tokenizer_json(tiny):
    from pagedecode.model.default_model import default_model_path
    folder, cfg, weights, meta = tiny
    path = folder / "tok.gguf"
    write_gguf(path, cfg, {k: v for k, v in weights.items()}, meta)
    tok = pd.Engine.from_pretrained(path).tokenizer
    ref = Tokenizer.from_dir(default_model_path())
    assert tok.kind == ref.kind == "bytelevel"
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_ids) == (ref.vocab_size, ref.bos_token_id, ref.eos_token_ids)
    for s in sample_strings(300, seed=2) + ["<|bos|>hi<|eos|>"]:
        ids = ref.encode(s)
        assert tok.encode(s) == ids, s
        assert tok.decode(ids) == ref.decode(ids), s
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False), s


def test_unsupported_tensor_type_is_named(tiny):
    folder, cfg, weights, meta = tiny
    path = folder / "q5.gguf"
    write_gguf(path, cfg, weights, meta, qtype=Q.Q5_0)
    data = bytearray(path.read_bytes())
    reader = gguf.GGUFReader(str(path))
    t = next(t for t in reader.tensors if t.tensor_type == Q.Q5_0)
    at = bytes(data).index(t.name.encode()) + len(t.name) + 4 + 8 * len(t.shape)   # name, dims, shape: the type
    assert int.from_bytes(data[at:at + 4], "little") == Q.Q5_0
    data[at:at + 4] = int(Q.IQ2_XXS).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=f"{t.name} has type IQ2_XXS"):
        pd.Engine.from_pretrained(path)


def test_not_a_gguf_file_is_named(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a model")
    with pytest.raises(ModelLoadError, match="neither a GGUF file nor a model directory"):
        pd.Engine.from_pretrained(bad)


@pytest.mark.parametrize("qtype", BLOCK_QTYPES, ids=lambda q: q.name)
def test_written_quantized_gguf_in_the_compiled_forward(tiny, qtype):
    """Every weight in blocks, the embedding and head included: the one-call compiled forward
    (int8 activations) against the dequantizing torch path, and the same tokens alone or batched."""
    folder, cfg, weights, meta = tiny
    path = folder / f"compiled-{qtype.name}.gguf"
    write_gguf(path, cfg, weights, meta, qtype=qtype)
    from pagedecode.model.cpu_forward import cpu_extension_available
    if not cpu_extension_available():
        pytest.skip("pagedecode._cpu not built")
    engine = pd.Engine.from_pretrained(path)
    assert engine.model.uses_cpu_extension()
    reference = pd.Engine.from_pretrained(path, attention_backend="torch").model
    ids = list(range(5, 45))
    ref = logits_of(reference, ids)
    assert (logits_of(engine.model, ids) - ref).abs().max() < 0.03 * ref.abs().max()
    prompts = [[1, 5, 9, 200], [1, 7], list(range(3, 40))]
    together = engine.generate(prompts, pd.SamplingParams(max_tokens=12, ignore_eos=True))
    for p, out in zip(prompts, together):
        alone = engine.generate([p], pd.SamplingParams(max_tokens=12, ignore_eos=True))[0]
        assert out.token_ids == alone.token_ids


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_written_qwen_gguf(tiny, arch):
    """qwen2 (q/k/v biases) and qwen3 (q/k norms, head_dim from key_length): no q/k permutation."""
    folder, cfg, weights, meta = tiny
    cfg = dict(cfg, model_type=arch)
    weights = dict(weights)
    g = torch.Generator().manual_seed(7)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn."
        if arch == "qwen2":
            for n, rows in (("q", 256), ("k", 128), ("v", 128)):
                weights[p + f"{n}_proj.bias"] = torch.randn(rows, generator=g)
        else:
            cfg["head_dim"] = 64
            for n in "qk":
                weights[p + f"{n}_norm.weight"] = 1 + 0.1 * torch.randn(64, generator=g)
    path = folder / f"{arch}.gguf"
    expected = write_gguf(path, cfg, weights, meta, arch=arch)
    model = pd.Engine.from_pretrained(path, attention_backend="torch").model
    assert model.config.model_type == arch and model.config.qk_norm == (arch == "qwen3")
    ref = LlamaModel(ModelConfig.from_hf(cfg), expected, attention_backend="torch")
    ids = list(range(5, 30))
    torch.testing.assert_close(logits_of(model, ids), logits_of(ref, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("qtype", BLOCK_QTYPES, ids=lambda q: q.name)
def test_tensor_bytes_are_checked_against_shape_and_type(qtype):
    """Before anything is copied: a tensor whose bytes are one block short (a truncated file), or
    whose shape is not whole blocks, is refused naming it."""
    from types import SimpleNamespace

    from pagedecode.model.gguf_file import read_tensor
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 3, 2 * block
    good = np.zeros(rows * 2 * type_size, dtype=np.uint8)
    t = SimpleNamespace(name="blk.0.attn_q.weight", tensor_type=qtype, shape=[cols, rows], data=good)
    assert read_tensor(t).shape == (rows, cols)
    with pytest.raises(ModelLoadError, match=f"blk.0.attn_q.weight: {good.size - type_size} bytes .* takes {good.size}"):
        read_tensor(SimpleNamespace(**{**vars(t), "data": good[:-type_size]}))
    with pytest.raises(ModelLoadError, match=f"blk.0.attn_q.weight: rows of {cols + 16} inputs are not whole"):
        read_tensor(SimpleNamespace(**{**vars(t), "shape": [cols + 16, rows]}))


def test_a_mix_of_block_types_keeps_each_tensor_in_its_own(tiny):
    """A mix as llama.cpp's Q4_K_M writes one (attn_v above attn_q / attn_k): q, k and v of three
    types are kept each in its blocks (a RowStack: no float copy), the model runs the compiled
    forward with a matmul per part (tests/model/test_compiled_mix.py), and holds exactly the file's bytes."""
    from pagedecode.model.quant import RowStack
    folder, cfg, weights, meta = tiny
    path = folder / "mix.gguf"
    mix = {"q_proj": Q.Q5_0, "k_proj": Q.Q4_K, "v_proj": Q.Q8_0, "o_proj": Q.Q5_1, "gate_proj": Q.Q4_K,
           "up_proj": Q.Q4_K, "down_proj": Q.Q6_K, "embed_tokens": Q.Q4_1, "lm_head": Q.Q5_K}
    expected = write_gguf(path, cfg, weights, meta, qtypes=mix)
    engine = pd.Engine.from_pretrained(path)
    model = engine.model
    assert model.uses_cpu_extension() == (model._compiled is not None)
    L = model.layers[0]
    assert isinstance(L.qkv_w, RowStack) and [p.kind for p in L.qkv_w.parts] == ["q5_0", "q4_k", "q8_0"]
    assert (L.gate_up_w.kind, L.down_w.kind, L.o_w.kind) == ("q4_k", "q6_k", "q5_1")
    assert (model.embed.kind, model.lm_head.kind) == ("q4_1", "q5_k")
    assert engine.weight_bytes == sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)
    ref = LlamaModel(ModelConfig.from_hf(cfg), expected, attention_backend="torch")
    ids = list(range(5, 45))
    want = logits_of(ref, ids)
    torch.testing.assert_close(logits_of(pd.Engine.from_pretrained(path, attention_backend="torch").model, ids),
                               want, atol=2e-4, rtol=1e-4)
    # int8 activations, per 256 for the K-quants (Q8_K): measured 5% of the largest logit here
    assert (logits_of(model, ids) - want).abs().max() < 0.08 * want.abs().max()
