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

and, read by torch's OpenMP runtime (libgomp) once, when `import pagedecode` first imports torch:
    OMP_WAIT_POLICY,       unset: GOMP_SPINCOUNT=1000    how long torch's OpenMP threads spin after a
    GOMP_SPINCOUNT                                       parallel region before they sleep (see
                                                         openmp_spins_briefly); either one set keeps
                                                         libgomp's own default (300,000 spins)

A value other than the one named keeps the default. An EngineConfig field given explicitly wins
over its variable. Build-time switches (PAGEDECODE_NO_CPU_EXT, PAGEDECODE_PORTABLE) are setup.py's,
read before this package exists; the tests' and benchmarks' own (PAGEDECODE_SHARED,
PAGEDECODE_STORIES, PAGEDECODE_SLOW) are theirs.
"""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Iterator

CPU_MATMUL = "PAGEDECODE_CPU_MATMUL"
CPU_PACK = "PAGEDECODE_CPU_PACK"
MALLOC = "PAGEDECODE_MALLOC"
CACHE = "PAGEDECODE_CACHE"
TRITON = "PAGEDECODE_TRITON"
OMP_WAIT_POLICY = "OMP_WAIT_POLICY"
GOMP_SPINCOUNT = "GOMP_SPINCOUNT"
BRIEF_SPINS = "1000"


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


@contextlib.contextmanager
def openmp_spins_briefly() -> Iterator[None]:
    """GOMP_SPINCOUNT=1000 while torch is first imported (libgomp reads it when torch loads it),
    unless OMP_WAIT_POLICY or GOMP_SPINCOUNT is set (the user's choice wins) or torch is imported
    already (too late); afterwards the variable is removed again, so that the processes this one
    starts (a peer engine in a benchmark) see the environment as it was.

    Why: after each parallel region libgomp's threads spin 300,000 pauses (milliseconds) before
    they sleep. Beside a busy process the spinning thread burns the time slice a descheduled peer
    needs to finish the next region: stories260k's 64-request workload (its prefill on oneDNN and
    ATen's attention) kept 0.43 of its idle tokens/s beside one busy neighbour at libgomp's
    default, 0.70 at 1,000 spins (tens of microseconds: the next region of a forward comes sooner),
    0.81 with OMP_WAIT_POLICY=passive, which wakes a sleeping thread for every region."""
    if OMP_WAIT_POLICY in os.environ or GOMP_SPINCOUNT in os.environ or "torch" in sys.modules:
        yield
        return
    os.environ[GOMP_SPINCOUNT] = BRIEF_SPINS
    try:
        yield
    finally:
        os.environ.pop(GOMP_SPINCOUNT, None)
