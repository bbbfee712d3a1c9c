"""Per-request trace records, and their export as JSON lines or Chrome trace JSON (Perfetto)."""
from __future__ import annotations

import json
import time
from typing import Any, Iterable, Mapping


def now_us() -> float:
    return time.perf_counter_ns() / 1000.0


TRACE_LEVELS = ("off", "lifecycle", "tokens")


class Trace:
    """Ordered records of one request: {"t_us": ..., "kind": ..., **fields}.

    level "lifecycle" keeps transitions, cancels, deadlines, preemptions, releases and stop
    hits; "tokens" adds a record per selection, decode, prefill chunk and delta; "off" none."""

    def __init__(self, request_id: str, level: str = "lifecycle") -> None:
        self.request_id = request_id
        self.records: list[dict[str, Any]] = []
        self.closed = level == "off"
        self.tokens = level == "tokens"

    def add(self, kind: str, **fields: Any) -> None:
        if not self.closed:
            self.records.append({"t_us": now_us(), "kind": kind, **fields})

    def token(self, kind: str, **fields: Any) -> None:
        """A per-token record: kept only at level "tokens"."""
        if self.tokens and not self.closed:
            self.records.append({"t_us": now_us(), "kind": kind, **fields})


def _jsonable(v: Any) -> Any:
    if hasattr(v, "value"):
        return v.value
    if isinstance(v, tuple):
        return list(v)
    return v


def to_jsonl(records: Iterable[Mapping]) -> str:
    return "".join(json.dumps({k: _jsonable(v) for k, v in r.items()}, default=str) + "\n"
                   for r in records)


def to_chrome(traces: Mapping[str, Iterable[Mapping]], steps: Iterable[Mapping] = (),
              wall_offset_us: float = 0.0) -> dict:
    """Chrome trace JSON: each request an async track (its records as instant events inside),
    each engine step a complete slice on the "engine" thread. wall_offset_us (Engine's) turns
    the monotonic timestamps into wall-clock microseconds."""
    events = [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "pagedecode"}},
              {"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "engine"}}]
    for step in steps:
        events.append({"name": f"step {step['step']}", "ph": "X", "pid": 1, "tid": 1,
                       "ts": step["t_us"] + wall_offset_us, "dur": step["dur_us"],
                       "args": {k: v for k, v in step.items() if k not in ("t_us", "dur_us")}})
    for rid, records in traces.items():
        records = list(records)
        if not records:
            continue
        common = {"cat": "request", "id": str(rid), "pid": 1}
        events.append({**common, "name": f"request {rid}", "ph": "b", "tid": 2,
                       "ts": records[0]["t_us"] + wall_offset_us})
        for r in records:
            args = {k: _jsonable(v) for k, v in r.items() if k not in ("t_us", "kind")}
            events.append({**common, "name": r["kind"], "ph": "n", "tid": 2, "ts": r["t_us"] + wall_offset_us,
                           "args": args})
        events.append({**common, "name": f"request {rid}", "ph": "e", "tid": 2,
                       "ts": records[-1]["t_us"] + wall_offset_us})
    return {"traceEvents": events, "displayTimeUnit": "ms"}
