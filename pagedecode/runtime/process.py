"""What the engine changes for the whole process, applied in one place: `ProcessEffects`, which
each Engine holds (`engine.process`) and which puts back on Engine.close what can be put back.

    effect                              applied by                          on Engine.close
    torch's intra-op threads            Engine() (num_threads); an          the count before the
                                        AsyncEngine lends a core to its     engine set it
                                        event loop while it runs
    the garbage collector's frozen      freeze_heap() (`pagedecode serve`,  gc.unfreeze(), when the
    generation                          after loading)                      heap was not frozen before
    glibc's malloc thresholds           Engine(), for a model on the        stays (see keep_freed_memory)
                                        compiled CPU forward
    malloc_trim after a load            Engine.from_pretrained              nothing to undo: a one-off

The garbage collector: with torch imported the process holds ~170,000 container objects (torch's
modules and types), and every full collection walks all of them: ~100 ms on the reference
machine, a pause that lands in some decode step every few seconds under load. Objects that live
for the whole process (modules, the model, the engine) need not be walked: freezing moves
everything alive now into the collector's permanent generation, so later full collections see only
what came after (vLLM's engine does the same). Frozen objects are never reclaimed by the cycle
collector (reference counting still frees them), so freeze once, after start-up, not per request.
"""
from __future__ import annotations

import ctypes
import gc
import logging

import torch

from ..model import cpu_forward
from .threads import allowed_cpus

log = logging.getLogger("pagedecode")


class ProcessEffects:
    """One engine's changes to the process, and their undoing (`restore`, from Engine.close)."""

    def __init__(self) -> None:
        self._threads_before: int | None = None     # torch's count before the first set_threads
        self._unfreeze = False                      # this engine froze a heap that was not frozen

    def set_threads(self, n: int) -> None:
        """torch's intra-op threads (which the compiled forward's pool takes) to n, on the calling
        thread (OpenMP keeps the count per thread); the first call's count before is put back by
        restore()."""
        before = apply_num_threads(n)
        if self._threads_before is None:
            self._threads_before = before

    def freeze_heap(self) -> int:
        """freeze_heap(), undone by restore() if nothing was frozen before: gc has one frozen
        generation and no partial unfreeze, so a heap someone else froze first stays frozen."""
        if gc.get_freeze_count() == 0:
            self._unfreeze = True
        return freeze_heap()

    def keep_freed_memory(self) -> bool:
        """glibc's malloc keeps what a step frees for the next step (csrc/cpu_forward.cpp
        keep_freed_memory: its mmap and trim thresholds, set once per process). Never undone:
        setting M_MMAP_THRESHOLD switches off glibc's own threshold adjustment for good (mallopt
        has no way back to it), and other engines of the process may rely on the setting."""
        return cpu_forward.keep_freed_memory()

    def restore(self) -> None:
        """Put back what can be put back (idempotent): torch's thread count; the frozen heap (which
        must also thaw before the process ends: at interpreter teardown frozen objects are never
        collected, and nanobind extensions (triton's) then report each one as leaked)."""
        if self._threads_before is not None:
            apply_num_threads(self._threads_before)
            self._threads_before = None
        if self._unfreeze:
            gc.unfreeze()
            self._unfreeze = False


def apply_num_threads(n: int) -> int:
    """Set torch's intra-op threads to n; returns the count before. More threads than the cores
    available are allowed, with a warning: their workers would take turns on the cores."""
    before = torch.get_num_threads()
    cores = len(allowed_cpus())
    if n > cores:
        log.warning("num_threads=%d is more than the %d CPUs this process may use: the workers will take turns "
                    "on them and each step waits for the slowest", n, cores)
    if n != before:
        torch.set_num_threads(n)
    return before


def freeze_heap() -> int:
    """Collect, then freeze every object alive now; returns how many are frozen (`pd.freeze_heap`)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def return_freed_memory() -> bool:
    """Hand the heap memory a load freed back to the kernel (glibc's malloc_trim): the checkpoint's
    tensors, the float copies a quantization or a dequantized format made, the layers before they
    were stacked. glibc keeps freed blocks below its mmap threshold (which its frees of large
    blocks raise, up to 32 MiB) for reuse, so without this the process would hold the load's peak
    for good, not what the model holds. False where there is no malloc_trim (not glibc)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True
