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


S = RequestState
TERMINAL = frozenset({S.FINISHED, S.CANCELLED, S.FAILED})
ALLOWED: dict[RequestState, frozenset[RequestState]] = {
    S.CREATED: frozenset({S.QUEUED, S.FAILED}),
    S.QUEUED: frozenset({S.PREFILLING, S.FAILED, S.CANCEL_REQUESTED}),
    S.PREFILLING: frozenset({S.DECODING, S.DRAINING, S.FAILED, S.CANCEL_REQUESTED}),   # DRAINING: max_tokens 0
    S.DECODING: frozenset({S.DRAINING, S.FAILED, S.CANCEL_REQUESTED}),
    S.DRAINING: frozenset({S.FINISHED, S.FAILED}),
    S.CANCEL_REQUESTED: frozenset({S.CANCELLED}),
    S.FINISHED: frozenset(),
    S.CANCELLED: frozenset(),
    S.FAILED: frozenset(),
}


def check_transition(current: RequestState, new: RequestState) -> None:
    """Raise IllegalTransitionError unless current -> new is in ALLOWED."""
    if new not in ALLOWED[current]:
        raise IllegalTransitionError(f"illegal request state move {current.value} -> {new.value}")
