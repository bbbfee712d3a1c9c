"""A request's result as `Engine.result` / `generate` return it (built by delivery.py from the
request and its history): text, ids, logprobs, state, finish reason, usage and timings."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..lifecycle import FinishReason, RequestState
from .events import TopLogprobs, Usage

STOP_RULE_VERSION = 1   # earliest end, then longest, then list order


@dataclass
class Timings:
    queue_s: float = 0.0         # added -> first scheduled
    prefill_s: float = 0.0       # time in steps that computed its prompt
    decode_s: float = 0.0        # time in steps that computed one of its tokens
    hold_s: float = 0.0          # text held back by the stop matcher, summed over characters' waits
    send_s: float = 0.0          # events waiting in the outgoing buffer for the consumer


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]               # returned ids (released with their text)
    text: str
    state: RequestState
    finish_reason: FinishReason | None
    stop_reason: str | int | tuple[int, ...] | None
    usage: Usage
    error: str | None = None
    selected_token_ids: list[int] = field(default_factory=list)   # every decision, EOS included
    logprobs: list[float | None] | None = None
    top_logprobs: list[TopLogprobs] | None = None
    stop_rule_version: int = STOP_RULE_VERSION
    # SamplingParams.prompt_logprobs: prompt token j's logprob (None for the first token), and its
    # N most likely alternatives at that position ((id, logprob) x N; None when N is 0)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[TopLogprobs | None] | None = None
    timings: Timings = field(default_factory=Timings)

    @property
    def finished(self) -> bool:
        return self.state.terminal
