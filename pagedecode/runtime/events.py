"""What a request produces: ordered events, usage, timings and the final RequestOutput."""
from __future__ import annotations

from dataclasses import dataclass, field

from .lifecycle import FinishReason, RequestState

STOP_RULE_VERSION = 1   # earliest end, then longest, then list order
TopLogprobs = tuple[tuple[int, float], ...]     # one token's N most likely alternatives: (id, logprob) x N


@dataclass
class Usage:
    prompt_tokens: int = 0
    selected_tokens: int = 0     # decisions made (EOS and absorbed stop tokens included)
    processed_tokens: int = 0    # tokens whose K/V were written (recompute after preemption too)
    returned_tokens: int = 0     # token ids the client received in deltas
    returned_bytes: int = 0      # UTF-8 bytes of the text the client received
    cached_tokens: int = 0       # prompt tokens whose K/V came from the prefix cache
    draft_tokens: int = 0        # speculative decoding: tokens proposed for it and verified
    accepted_draft_tokens: int = 0   # ... of them selected (each is also one of selected_tokens)


@dataclass
class Timings:
    queue_s: float = 0.0         # added -> first scheduled
    prefill_s: float = 0.0       # time in steps that computed its prompt
    decode_s: float = 0.0        # time in steps that computed one of its tokens
    hold_s: float = 0.0          # text held back by the stop matcher, summed over characters' waits
    send_s: float = 0.0          # events waiting in the outgoing buffer for the consumer


@dataclass(frozen=True)
class StartEvent:
    request_id: str
    seq: int
    model: str


@dataclass(frozen=True)
class DeltaEvent:
    request_id: str
    seq: int
    text: str                          # complete UTF-8: never half a character
    token_ids: tuple[int, ...]
    logprobs: tuple[float | None, ...] | None = None
    top_logprobs: tuple[TopLogprobs, ...] | None = None   # per token: (id, logprob) x N


@dataclass(frozen=True)
class TerminalEvent:
    request_id: str
    seq: int
    state: RequestState
    finish_reason: FinishReason | None
    usage: Usage
    error: str | None = None
    stop_reason: str | int | tuple[int, ...] | None = None


Event = StartEvent | DeltaEvent | TerminalEvent


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
