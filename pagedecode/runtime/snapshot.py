"""The engine at one moment, as outer layers may see it: a frozen record that `Engine.snapshot()`
takes under the engine's lock, so the server's /metrics, the CLI and benchmarks read numbers,
never the scheduler, the page pool or the engine's private fields.

Gauges say how things stand now; counters only grow, from the engine's start.
"""
from __future__ import annotations

from dataclasses import dataclass


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
