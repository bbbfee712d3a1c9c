"""Metering one ended request: its figures into the metrics, and one log line (JSON) that
names it, its tenant and its ending, and never its text unless --log-text."""
from __future__ import annotations

import json
import logging
import time
from typing import Any

from ..runtime.output.result import RequestOutput
from .metrics import Metrics
from .openai_shapes import reason_name
from .tracks import Track

log = logging.getLogger("pagedecode.server")


def observe(m: Metrics, track: Track, out: RequestOutput) -> None:
    u = out.usage
    m.prompt_tokens.inc(u.prompt_tokens)
    m.generation_tokens.inc(u.returned_tokens)
    m.ended(out.finish_reason)
    m.e2e.observe(time.perf_counter() - track.arrival)
    m.queue.observe(out.timings.queue_s)
    m.prefill.observe(out.timings.prefill_s)
    m.decode.observe(out.timings.decode_s)
    if track.first_token is not None:
        m.ttft.observe(track.first_token - track.arrival)
    if track.disconnects:
        m.disconnects.inc()


def log_record(track: Track, out: RequestOutput, model_name: str, log_text: bool) -> None:
    u = out.usage
    record: dict[str, Any] = {
        "request_id": out.request_id, "tenant": track.tenant, "model": model_name, "state": out.state.value,
        "finish_reason": reason_name(out.finish_reason), "error": out.error,
        "prompt_tokens": u.prompt_tokens, "selected_tokens": u.selected_tokens,
        "processed_tokens": u.processed_tokens, "returned_tokens": u.returned_tokens,
        "queue_s": round(out.timings.queue_s, 6), "prefill_s": round(out.timings.prefill_s, 6),
        "decode_s": round(out.timings.decode_s, 6),
        "ttft_s": None if track.first_token is None else round(track.first_token - track.arrival, 6),
        "retries": track.retries, "resumes": track.resumes, "disconnects": track.disconnects}
    if log_text:
        record["text"] = out.text
    log.info("request %s", json.dumps(record))
