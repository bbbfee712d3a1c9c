"""llama.cpp beside pagedecode on the same GGUF files: where its build is, the files of every
block type made from one float32 file by its own llama-quantize, and its answers read back --
greedy tokens (pd-greedy), every position's logits (pd-logits), token ids (llama-tokenize) and
perplexity (llama-perplexity).

benchmarks/peers/llamacpp.sh builds the tools into benchmarks/.cache/llamacpp/bin (LLAMACPP_BIN
names another folder); the files are cached under benchmarks/.cache.
The benchmarks and the tests (tests/model/test_llamacpp_*.py) share this module.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
# llama-quantize's names for the types pagedecode keeps in blocks. The "_M" mixes keep some
# tensors above the named type (attn_v / ffn_down in Q6_K, ...), and rows that are not whole
# super-blocks of 256 (SmolLM2's hidden 576) fall back to Q5_0 / Q5_1 / Q8_0: as people download them.
QUANTIZE_TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1", "q5_0": "Q5_0", "q5_1": "Q5_1",
                  "q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M", "q6_k": "Q6_K"}


def cache_dir() -> Path:
    folder = HERE / ".cache"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def bin_dir() -> Path:
    return Path(os.environ.get("LLAMACPP_BIN", HERE / ".cache" / "llamacpp" / "bin"))


def missing(*tools: str) -> str | None:
    """Why these llama.cpp tools cannot run here (naming them), or None."""
    absent = [t for t in tools if not (bin_dir() / t).is_file()]
    if absent:
        return (f"llama.cpp's {', '.join(absent)} not built in {bin_dir()} "
                "(benchmarks/peers/llamacpp.sh builds them; LLAMACPP_BIN names another folder)")
    return None


def quantized_file(f32: Path, kind: str) -> Path:
    """`f32` (an F32 GGUF) in llama-quantize's `kind` (QUANTIZE_TYPES), cached beside the others."""
    out = cache_dir() / f"{f32.name.split('.')[0]}.{QUANTIZE_TYPES[kind]}.gguf"
    if not out.is_file():
        tmp = out.with_suffix(".part")
        subprocess.run([str(bin_dir() / "llama-quantize"), "--allow-requantize", str(f32), str(tmp),
                        QUANTIZE_TYPES[kind], "2"], check=True, capture_output=True)
        tmp.rename(out)
    return out


def tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each type a file holds (what llama-quantize chose)."""
    from gguf import GGUFReader
    counts: dict[str, int] = {}
    for t in GGUFReader(str(path)).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return counts


def tensor_bytes(path: Path) -> int:
    """The bytes of a file's tensors (what engine.weight_bytes is held to)."""
    from gguf import GGUFReader
    return sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)


def random_1b_f32(layers: int = 2, seed: int = 0) -> Path:
    """A random Llama of a 1B model's shape (Llama 3.2 1B: hidden 2048, FFN 8192, 32 heads of 64,
    8 KV heads, an untied output) with SmolLM2's tokenizer (vocab 49152) as an F32 GGUF, cached.
    `layers` of them, not 16: every layer multiplies the same shapes in the same types, so two
    already put every matrix role in K-quants (and a second layer's attention over the first's
    output) at an eighth of the file and the time on a shared CPU. The output head's scale is
    raised so that the next-token distributions are peaked as a trained model's are (random
    weights at 1 / sqrt(K) give near-uniform ones, where KL and argmax say little)."""
    out = cache_dir() / f"random1b-{layers}L.f32.gguf"
    if out.is_file():
        return out
    from gguf import GGUFReader, GGUFValueType, GGUFWriter
    from real_model import smollm2_gguf
    h, f, heads, kv_heads, dim, vocab = 2048, 8192, 32, 8, 64, 49152
    rng = np.random.default_rng(seed)

    def r(rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * (scale / np.sqrt(cols))).astype(np.float32)

    tmp = out.with_suffix(".part")
    w = GGUFWriter(str(tmp), "llama")
    w.add_context_length(4096)
    w.add_embedding_length(h)
    w.add_block_count(layers)
    w.add_feed_forward_length(f)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(500000.0)
    w.add_rope_dimension_count(dim)
    w.add_file_type(0)
    for name, field in GGUFReader(str(smollm2_gguf())).fields.items():
        if name.startswith("tokenizer."):
            kind = field.types[0]
            w.add_key_value(name, field.contents(), kind, sub_type=field.types[-1] if kind == GGUFValueType.ARRAY else None)
    w.add_tensor("token_embd.weight", rng.standard_normal((vocab, h), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    w.add_tensor("output.weight", r(vocab, h, 8.0))
    for i in range(layers):
        for name, t in (("attn_norm", np.ones(h, np.float32)), ("ffn_norm", np.ones(h, np.float32)),
                        ("attn_q", r(heads * dim, h)), ("attn_k", r(kv_heads * dim, h)),
                        ("attn_v", r(kv_heads * dim, h)), ("attn_output", r(h, heads * dim)),
                        ("ffn_gate", r(f, h)), ("ffn_up", r(f, h)), ("ffn_down", r(h, f))):
            w.add_tensor(f"blk.{i}.{name}.weight", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(out)
    return out


# -- llama.cpp's answers ---------------------------------------------------------------------------
def _ids_text(seqs: list[list[int]]) -> str:
    return "".join(" ".join(str(i) for i in s) + "\n" for s in seqs)


def greedy(model: Path, prompts: list[list[int]], n_new: int, threads: int = 2, kv: str = "f16",
           flash: str = "auto") -> list[list[int]]:
    """llama.cpp's greedy continuation of each prompt (token ids), by pd-greedy (peers/greedy.cpp);
    kv, flash: its cache type and flash attention, as logits() takes them."""
    out = subprocess.run([str(bin_dir() / "pd-greedy"), str(model), str(n_new), str(threads), kv, flash],
                         input=_ids_text(prompts), capture_output=True, text=True, check=True).stdout
    return [[int(i) for i in line.split()] for line in out.strip().splitlines()]


def logits(model: Path, seqs: list[list[int]], threads: int = 2, kv: str = "f16",
           flash: str = "auto") -> list[np.ndarray]:
    """llama.cpp's logits (len, vocab) at every position of each sequence, teacher-forced, by
    pd-logits (peers/logits.cpp). kv: its cache type (f16, its default, or f32); flash: flash
    attention auto (its default) / on / off."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "logits.bin"
        done = subprocess.run([str(bin_dir() / "pd-logits"), str(model), str(threads), str(path), kv, flash],
                              input=_ids_text(seqs), capture_output=True, text=True, check=True)
        vocab = int(done.stdout.split()[-1])
        flat = np.fromfile(path, dtype=np.float32)
    out, at = [], 0
    for s in seqs:
        out.append(flat[at:at + len(s) * vocab].reshape(len(s), vocab))
        at += len(s) * vocab
    assert at == flat.size, (at, flat.size)
    return out


def tokenize(model: Path, text: str, special: bool = False) -> list[int]:
    """llama.cpp's token ids of `text` (llama-tokenize; BOS as the file's add_bos_token says;
    special: the special tokens' strings read as those tokens, as a rendered chat needs)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "text.txt"
        path.write_bytes(text.encode())
        args = [str(bin_dir() / "llama-tokenize"), "-m", str(model), "-f", str(path), "--ids", "--log-disable",
                "--no-escape"] + ([] if special else ["--no-parse-special"])
        out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    return [int(i) for i in re.findall(r"-?\d+", out.strip().splitlines()[-1])]


def perplexity(model: Path, text: str, n_ctx: int, chunks: int, threads: int = 2) -> float:
    """llama-perplexity's final estimate over `text` (no trailing newline: its -f drops one):
    `chunks` windows of n_ctx tokens, each scored on its second half."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "text.txt"
        path.write_bytes(text.encode())
        done = subprocess.run([str(bin_dir() / "llama-perplexity"), "-m", str(model), "-f", str(path), "-c", str(n_ctx),
                               "-b", str(n_ctx), "--chunks", str(chunks), "-t", str(threads)],
                              capture_output=True, text=True, check=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", done.stdout + done.stderr)
    assert found, (done.stdout + done.stderr)[-2000:]
    return float(found.group(1))
