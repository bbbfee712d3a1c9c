"""Prometheus metrics, named after vLLM's with a `pagedecode:` prefix, in a registry per app.
With compat "vllm" (`--metrics-compat vllm`) the gauges an inference gateway's endpoint picker
reads (the Gateway API Inference Extension, as llm-d and KServe run it) are also exported under
vLLM's own names: `vllm:num_requests_waiting`, `vllm:num_requests_running`,
`vllm:kv_cache_usage_perc` (a fraction, as vLLM's is), labelled with `model_name`. vLLM's LoRA
info gauge is left out: there are no adapters to report.

Per-request figures (latencies, tokens returned, endings) are counted by the server as it meters
each request. The engine's own gauges and counters (requests running and waiting, KV usage,
preemptions, prefix-cache lookups) are read from one `engine.snapshot()` at scrape time by
`EngineCollector`: the server keeps no copy of them.
"""
from __future__ import annotations

import time
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..runtime.lifecycle import FinishReason
from ..runtime.snapshot import EngineSnapshot

# a request that ended as asked: its text complete (a stop, EOS, the grammar) or its length
# reached; every other reason (cancelled, deadline_exceeded, content_interrupted, model_error,
# transport_error) is a failure
SUCCESSES = frozenset({FinishReason.EOS, FinishReason.STOP_SEQUENCE, FinishReason.GRAMMAR_COMPLETE,
                       FinishReason.MAX_OUTPUT_TOKENS, FinishReason.CONTEXT_LIMIT})
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
P = "pagedecode:"
COMPATS = ("vllm",)


class EngineCollector(Collector):
    """The engine's metrics, all from one snapshot taken when /metrics is scraped. Counters keep
    the exposition of a prometheus_client Counter: `NAME_total` and `NAME_created`."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot], compat: str | None = None,
                 model_name: str = "") -> None:
        if compat is not None and compat not in COMPATS:
            raise ValueError(f"metrics compat {compat!r}: expected one of {', '.join(COMPATS)}")
        self.snapshot = snapshot
        self.compat = compat
        self.model_name = model_name
        self.created = time.time()

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        gauges = (("num_requests_running", "Requests holding a batch slot", s.running),
                  ("num_requests_waiting", "Requests queued", s.waiting),
                  ("kv_cache_usage_perc", "Fraction of KV pages in use", s.kv_cache_usage))
        for name, doc, value in gauges:
            yield GaugeMetricFamily(P + name, doc, value=value)
        if self.compat == "vllm":
            for name, doc, value in gauges:
                g = GaugeMetricFamily("vllm:" + name, doc, labels=["model_name"])
                g.add_metric([self.model_name], value)
                yield g
        for name, doc, value in (
                ("num_preemptions", "Requests preempted", s.preemptions),
                ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache", s.prefix_cache_queries),
                ("prefix_cache_hits", "Prompt tokens served from the prefix cache", s.prefix_cache_hits),
                ("spec_decode_num_drafts", "Speculative verify runs (a request with drafts in a step)",
                 s.spec_decode_num_drafts),
                ("spec_decode_num_draft_tokens", "Draft tokens proposed and verified", s.spec_decode_num_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Draft tokens accepted (selected as proposed)",
                 s.spec_decode_num_accepted_tokens)):
            yield CounterMetricFamily(P + name, doc, value=value, created=self.created)


class Metrics:
    def __init__(self, snapshot: Callable[[], EngineSnapshot], compat: str | None = None,
                 model_name: str = "") -> None:
        r = self.registry = CollectorRegistry()

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(P + name, doc, registry=r, buckets=LATENCY_BUCKETS)
        self.ttft = hist("time_to_first_token_seconds", "Time from arrival to the first returned token")
        self.itl = hist("inter_token_latency_seconds", "Time between returned deltas")
        self.e2e = hist("e2e_request_latency_seconds", "Time from arrival to the terminal event")
        self.queue = hist("request_queue_time_seconds", "Time queued before first scheduled")
        self.prefill = hist("request_prefill_time_seconds", "Time in steps that computed the prompt")
        self.decode = hist("request_decode_time_seconds", "Time in steps that computed output tokens")
        r.register(EngineCollector(snapshot, compat, model_name))
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens returned to clients", registry=r)
        self.success = Counter(P + "request_success", "Requests that ended normally, by finish reason",
                               ["finished_reason"], registry=r)
        self.failure = Counter(P + "request_failure", "Requests cancelled, timed out or failed, by finish reason",
                               ["reason"], registry=r)
        self.disconnects = Counter(P + "disconnects", "Clients that went away before the end", registry=r)
        self.replays = Counter(P + "idempotent_replays", "Retries served from an existing request", registry=r)

    def ended(self, reason: FinishReason | None) -> None:
        """Count a request's ending: a success when it ended as asked (see SUCCESSES)."""
        if reason in SUCCESSES:
            self.success.labels(finished_reason=reason.value).inc()
        else:
            self.failure.labels(reason=reason.value if reason is not None else "none").inc()

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))
