"""What a request sends out: ordered events (start, deltas, one terminal event with its usage).
Its result, read at any time, is result.py's RequestOutput."""
from __future__ import annotations

from dataclasses import dataclass

from ..lifecycle import FinishReason, RequestState

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
    accepted_prediction_tokens: int = 0   # Predicted Outputs: the prediction's drafts selected ...
    rejected_prediction_tokens: int = 0   # ... and verified but not selected


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
