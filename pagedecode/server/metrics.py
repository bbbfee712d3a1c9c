"""Prometheus metrics, named after vLLM's with a `pagedecode:` prefix, in a registry per app."""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..runtime.lifecycle import FinishReason

# a request that ended as asked: its text complete (a stop, EOS, the grammar) or its length
# reached; every other reason (cancelled, deadline_exceeded, content_interrupted, model_error,
# transport_error) is a failure
SUCCESSES = frozenset({FinishReason.EOS, FinishReason.STOP_SEQUENCE, FinishReason.GRAMMAR_COMPLETE,
                       FinishReason.MAX_OUTPUT_TOKENS, FinishReason.CONTEXT_LIMIT})
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "pagedecode:"

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(p + name, doc, registry=r, buckets=LATENCY_BUCKETS)
        self.ttft = hist("time_to_first_token_seconds", "Time from arrival to the first returned token")
        self.itl = hist("inter_token_latency_seconds", "Time between returned deltas")
        self.e2e = hist("e2e_request_latency_seconds", "Time from arrival to the terminal event")
        self.queue = hist("request_queue_time_seconds", "Time queued before first scheduled")
        self.prefill = hist("request_prefill_time_seconds", "Time in steps that computed the prompt")
        self.decode = hist("request_decode_time_seconds", "Time in steps that computed output tokens")
        self.running = Gauge(p + "num_requests_running", "Requests holding a batch slot", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests queued", registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage_perc", "Fraction of KV pages in use", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens returned to clients", registry=r)
        self.success = Counter(p + "request_success", "Requests that ended normally, by finish reason",
                               ["finished_reason"], registry=r)
        self.failure = Counter(p + "request_failure", "Requests cancelled, timed out or failed, by finish reason",
                               ["reason"], registry=r)
        self.preemptions = Counter(p + "num_preemptions", "Requests preempted", registry=r)
        self.disconnects = Counter(p + "disconnects", "Clients that went away before the end", registry=r)
        self.replays = Counter(p + "idempotent_replays", "Retries served from an existing request", registry=r)
        self.prefix_queries = Counter(p + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter(p + "prefix_cache_hits", "Prompt tokens served from the prefix cache",
                                   registry=r)

    def ended(self, reason: FinishReason | None) -> None:
        """Count a request's ending: a success when it ended as asked (see SUCCESSES)."""
        if reason in SUCCESSES:
            self.success.labels(finished_reason=reason.value).inc()
        else:
            self.failure.labels(reason=reason.value if reason is not None else "none").inc()

    def refresh(self, engine: Any) -> None:
        self.running.set(len(engine.scheduler.running))
        self.waiting.set(len(engine.scheduler.waiting))
        pool = engine.pool
        self.kv_usage.set((pool.num_pages - pool.free_pages) / pool.num_pages)

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))
