"""The cyclic garbage collector and a long-running engine.

With torch imported the process holds ~170,000 container objects (torch's modules and types),
and every full collection walks all of them: ~100 ms on the reference machine, a pause that
lands in some decode step every few seconds under load. Objects that live for the whole
process (modules, the model, the engine) need not be walked: `freeze_heap` moves everything
alive now into the collector's permanent generation, so later full collections see only what
came after. `pagedecode serve` calls it once after loading, as vLLM's engine does.

Frozen objects are never reclaimed by the cycle collector (reference counting still frees
them), so call it once, after start-up, not per request or per engine in a loop.
"""
from __future__ import annotations

import gc


def freeze_heap() -> int:
    """Collect, then freeze every object alive now; returns how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw_heap() -> None:
    """Undo freeze_heap before the process ends: at interpreter teardown frozen objects are
    never collected, and nanobind extensions (triton's) then report each one as leaked."""
    gc.unfreeze()
