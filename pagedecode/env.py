"""The environment variables pagedecode reads while it runs: every one is read here, nowhere else,
and each is read when it is asked for (not when this module is imported), so a process (or a
test's monkeypatch.setenv) that sets one before making an EngineConfig or a default model sees
its value.

    variable               default                   meaning
    PAGEDECODE_CPU_MATMUL  unset: "onednn"           "aten": EngineConfig.cpu_matmul's default is
                                                     at::mm for the compiled CPU forward's larger
                                                     matmuls instead of oneDNN's linear
    PAGEDECODE_CPU_PACK    unset: False              "1": EngineConfig.cpu_pack_weights' default is
                                                     True (a second, oneDNN-blocked copy of each
                                                     float weight)
    PAGEDECODE_MALLOC      unset: keep freed memory  "default": EngineConfig.cpu_keep_freed_memory's
                                                     default is False (glibc's malloc left as it is)
    PAGEDECODE_CACHE       ~/.cache/pagedecode       where the built-in default model is written
    PAGEDECODE_TRITON      unset: only where it runs "1": Triton imported under a CPU-only torch too
                                                     (ahead-of-time compiles for a GPU target:
                                                     tests/kernels/compile_hopper.py)

A value other than the one named keeps the default. An EngineConfig field given explicitly wins
over its variable. Build-time switches (PAGEDECODE_NO_CPU_EXT, PAGEDECODE_PORTABLE) are setup.py's,
read before this package exists; the tests' and benchmarks' own (PAGEDECODE_SHARED,
PAGEDECODE_STORIES, PAGEDECODE_SLOW) are theirs.
"""
from __future__ import annotations

import os
from pathlib import Path

CPU_MATMUL = "PAGEDECODE_CPU_MATMUL"
CPU_PACK = "PAGEDECODE_CPU_PACK"
MALLOC = "PAGEDECODE_MALLOC"
CACHE = "PAGEDECODE_CACHE"
TRITON = "PAGEDECODE_TRITON"


def cpu_matmul() -> str:
    """EngineConfig.cpu_matmul's default: "aten" when PAGEDECODE_CPU_MATMUL=aten, else "onednn"."""
    return "aten" if os.environ.get(CPU_MATMUL) == "aten" else "onednn"


def cpu_pack_weights() -> bool:
    """EngineConfig.cpu_pack_weights' default: False (one resident copy of each weight) unless
    PAGEDECODE_CPU_PACK=1. The packed copy cannot replace the plain one: decode's gemv (a few
    rows) and the torch path read the plain weight."""
    return os.environ.get(CPU_PACK) == "1"


def keep_freed_memory() -> bool:
    """EngineConfig.cpu_keep_freed_memory's default: True unless PAGEDECODE_MALLOC=default."""
    return os.environ.get(MALLOC) != "default"


def cache_root() -> Path:
    """Where pagedecode writes what it makes for itself (the default model): PAGEDECODE_CACHE, or
    ~/.cache/pagedecode."""
    return Path(os.environ.get(CACHE) or Path.home() / ".cache" / "pagedecode")


def triton_wanted() -> bool:
    """Whether Triton is imported whatever this process's torch can run (PAGEDECODE_TRITON=1)."""
    return os.environ.get(TRITON) == "1"
