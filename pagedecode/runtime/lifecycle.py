"""Request states, finish reasons, and the one table of allowed moves between states."""
from __future__ import annotations

import enum

from ..errors import IllegalTransitionError


class RequestState(str, enum.Enum):
    CREATED = "created"
    QUEUED = "queued"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    DRAINING = "draining"            # finish reason fixed; flushing the last text
    FINISHED = "finished"
    CANCEL_REQUESTED = "cancel_requested"
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


class FinishReason(str, enum.Enum):
    EOS = "eos"
    STOP_SEQUENCE = "stop_sequence"
    GRAMMAR_COMPLETE = "grammar_complete"
    MAX_OUTPUT_TOKENS = "max_output_tokens"
    CONTEXT_LIMIT = "context_limit"
    CANCELLED = "cancelled"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    CONTENT_INTERRUPTED = "content_interrupted"
    MODEL_ERROR = "model_error"
    TRANSPORT_ERROR = "transport_error"


TERMINAL = frozenset({RequestState.FINISHED, RequestState.CANCELLED, RequestState.FAILED})
ALLOWED: dict[RequestState, frozenset[RequestState]] = {
    RequestState.CREATED: frozenset({RequestState.QUEUED, RequestState.FAILED}),
    RequestState.QUEUED: frozenset({RequestState.PREFILLING, RequestState.FAILED, RequestState.CANCEL_REQUESTED}),
    RequestState.PREFILLING: frozenset({RequestState.DECODING, RequestState.DRAINING,   # DRAINING: max_tokens 0
                                        RequestState.FAILED, RequestState.CANCEL_REQUESTED}),
    RequestState.DECODING: frozenset({RequestState.DRAINING, RequestState.FAILED, RequestState.CANCEL_REQUESTED}),
    RequestState.DRAINING: frozenset({RequestState.FINISHED, RequestState.FAILED}),
    RequestState.CANCEL_REQUESTED: frozenset({RequestState.CANCELLED}),
    RequestState.FINISHED: frozenset(),
    RequestState.CANCELLED: frozenset(),
    RequestState.FAILED: frozenset(),
}


def check_transition(current: RequestState, new: RequestState) -> None:
    """Raise IllegalTransitionError unless current -> new is in ALLOWED."""
    if new not in ALLOWED[current]:
        raise IllegalTransitionError(f"illegal request state move {current.value} -> {new.value}")
