"""llama.cpp beside the tests: where its build is (benchmarks/peers/llamacpp.sh builds it into
benchmarks/.cache/llamacpp/bin; LLAMACPP_BIN names another folder), an F32 GGUF of the real model
written once from its Q4_1 file's values, and llama-quantize's files of each type made from it,
all cached under ~/.cache/pagedecode (PAGEDECODE_CACHE moves it)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np

gguf = __import__("gguf")
REPO = Path(__file__).resolve().parents[2]
# llama-quantize's names of the types pagedecode keeps in blocks
QUANTIZE_TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1", "q5_0": "Q5_0", "q5_1": "Q5_1",
                  "q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M", "q6_k": "Q6_K"}


def llamacpp_bin() -> Path | None:
    """The folder holding llama-quantize and pd-greedy, or None when llama.cpp is not built."""
    folder = Path(os.environ.get("LLAMACPP_BIN", REPO / "benchmarks" / ".cache" / "llamacpp" / "bin"))
    return folder if (folder / "llama-quantize").is_file() and (folder / "pd-greedy").is_file() else None


def cache_dir() -> Path:
    folder = Path(os.environ.get("PAGEDECODE_CACHE", Path.home() / ".cache" / "pagedecode"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def write_f32_copy(source: Path, out: Path) -> Path:
    """`source`'s metadata and tensors, every block tensor dequantized (gguf's values) to F32."""
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    tmp = out.with_suffix(".part")
    w = gguf.GGUFWriter(str(tmp), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), field.types[0], sub)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        w.add_tensor(t.name, np.ascontiguousarray(values.reshape(tuple(int(n) for n in reversed(t.shape)))
                                                  .astype(np.float32)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(out)
    return out


def quantized_file(source: Path, kind: str, bin_dir: Path) -> Path:
    """The real model in llama-quantize's `kind` (QUANTIZE_TYPES), from its F32 copy; cached."""
    folder = cache_dir()
    f32 = folder / f"{source.stem}.F32.gguf"
    if not f32.is_file():
        write_f32_copy(source, f32)
    out = folder / f"{source.stem}.{QUANTIZE_TYPES[kind]}.gguf"
    if not out.is_file():
        tmp = out.with_suffix(".part")
        subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(f32), str(tmp),
                        QUANTIZE_TYPES[kind], "2"], check=True, capture_output=True)
        tmp.rename(out)
    return out


def llamacpp_greedy(model: Path, prompts: list[list[int]], n_new: int, bin_dir: Path, threads: int = 2) -> list[list[int]]:
    """llama.cpp's greedy continuation of each prompt (token ids), by pd-greedy (benchmarks/peers/greedy.cpp)."""
    text = "\n".join(" ".join(str(i) for i in p) for p in prompts) + "\n"
    out = subprocess.run([str(bin_dir / "pd-greedy"), str(model), str(n_new), str(threads)], input=text,
                         capture_output=True, text=True, check=True).stdout
    return [[int(i) for i in line.split()] for line in out.strip().splitlines()]
