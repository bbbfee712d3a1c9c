"""The engine at one moment, as outer layers may see it: a frozen record that `Engine.snapshot()`
takes under the engine's lock, so the server's /metrics, the CLI and benchmarks read numbers,
never the scheduler, the page pool or the engine's private fields.

Gauges say how things stand now; counters only grow, from the engine's start.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .scheduler import Scheduler
    from .spec import SpecCounters


@dataclass(frozen=True)
class EngineSnapshot:
    # -- requests now ------------------------------------------------------------------------
    running: int                # admitted: holding a batch slot (prefilling or decoding)
    waiting: int                # queued for a slot, preempted requests included
    paused: int                 # of those, held back by backpressure: their consumer is not reading
    finished_kept: int          # finished requests whose result, events and trace are still readable
    # -- resources now -----------------------------------------------------------------------
    pages_used: int             # KV pages held by at least one request
    pages_cached: int           # pages holding a cached prefix, held or not (an unheld one is reusable)
    pages_total: int            # the KV pool, in pages of EngineConfig.page_size tokens
    slots_used: int             # batch slots held (== running)
    slots_total: int            # EngineConfig.max_batch_size
    # -- counters since the engine started ---------------------------------------------------
    preemptions: int            # times a running request gave up its pages and slot (it recomputes later)
    prefix_cache_queries: int   # prompt tokens looked up in the prefix cache (at first admission)
    prefix_cache_hits: int      # ... of them found there, not computed
    steps: int                  # steps that ran the model
    prompt_tokens: int          # prompt tokens of the requests added
    generated_tokens: int       # tokens chosen for requests (EOS and stop tokens included)
    spec_decode_num_drafts: int = 0            # speculation: verify runs (a request with drafts in a step)
    spec_decode_num_draft_tokens: int = 0      # ... draft tokens proposed and verified
    spec_decode_num_accepted_tokens: int = 0   # ... of them accepted (selected as proposed)

    @property
    def kv_cache_usage(self) -> float:
        """The fraction of KV pages in use, in [0, 1]."""
        return self.pages_used / self.pages_total


def take_snapshot(sch: Scheduler, finished_kept: int, steps: int, prompt_tokens: int, generated_tokens: int,
                  spec: SpecCounters | None = None) -> EngineSnapshot:
    """One pass over the running and waiting requests (the caller holds the engine's lock)."""
    pool, slots = sch.pool, sch.slots
    paused = sum(r.delivery.paused_since is not None for r in sch.running) + \
        sum(r.delivery.paused_since is not None for r in sch.waiting)
    return EngineSnapshot(
        running=len(sch.running), waiting=len(sch.waiting), paused=paused, finished_kept=finished_kept,
        pages_used=pool.num_pages - pool.free_pages, pages_cached=pool.cached_pages, pages_total=pool.num_pages,
        slots_used=slots.num_slots - slots.free_slots, slots_total=slots.num_slots, preemptions=sch.preemptions,
        prefix_cache_queries=sch.cache_queries, prefix_cache_hits=sch.cache_hits, steps=steps,
        prompt_tokens=prompt_tokens, generated_tokens=generated_tokens,
        spec_decode_num_drafts=0 if spec is None else spec.drafts,
        spec_decode_num_draft_tokens=0 if spec is None else spec.draft_tokens,
        spec_decode_num_accepted_tokens=0 if spec is None else spec.accepted_tokens)
