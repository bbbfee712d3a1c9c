"""Request: one generation's state as the runtime keeps it.

Step state (DESIGN.md, "the off-by-one"): with prompt length m and t tokens selected,
    known tokens  = m + t                    (prompt + output)
    num_computed  = tokens whose K/V are in the cache
Between a selection and the next decode, num_computed == m + t - 1: the newest token is chosen
but not yet cached. A step computes known[num_computed : num_computed + n]; when that reaches
the end of the known tokens, its last logits choose token t + 1. Preemption sets num_computed
to 0 (pages gone) and nothing else: the output, seed and decoder state are untouched.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from ..errors import DoubleReleaseError
from ..params import SamplingParams
from .events import DeltaEvent, Event, RequestOutput, Timings, Usage
from .lifecycle import FinishReason, RequestState, check_transition
from .output import Emission, OutputPipeline
from .stream import EventBuffer
from .trace import Trace

RESOURCES = ("pages", "slot", "rng", "stream", "trace")


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: float
    pipeline: OutputPipeline
    trace: Trace
    deadline: float | None = None
    state: RequestState = RequestState.CREATED
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    num_computed: int = 0
    pages: list[int] = field(default_factory=list)
    slot: int | None = None
    admitted_order: int = -1            # larger = admitted later (preempted first)
    next_seq: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | tuple[int, ...] | None = None
    error: str | None = None
    cancel_requested_at: float | None = None
    cancel_reason: FinishReason = FinishReason.CANCELLED
    buffer: EventBuffer | None = None   # set when a consumer reads events itself (streaming)
    paused_since: float | None = None   # backpressure: buffer full since
    history: list[Event] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    returned_ids: list[int] = field(default_factory=list)
    returned_logprobs: list[float] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)
    timings: Timings = field(default_factory=Timings)
    first_scheduled: float | None = None
    released: set[str] = field(default_factory=set)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, position: int) -> int:
        m = len(self.prompt_ids)
        return self.prompt_ids[position] if position < m else self.output_ids[position - m]

    def transition(self, new: RequestState) -> None:
        check_transition(self.state, new)
        self.trace.add("state", old=self.state.value, new=new.value)
        self.state = new

    def take_seq(self) -> int:
        seq = self.next_seq
        self.next_seq += 1
        return seq

    def delta(self, em: Emission) -> DeltaEvent:
        """The next delta event, with the returned text, ids and usage counted."""
        lps = em.logprobs if self.params.logprobs is not None else None
        ev = DeltaEvent(self.request_id, self.take_seq(), em.text, em.token_ids, lps)
        self.text_parts.append(em.text)
        self.returned_ids.extend(em.token_ids)
        self.returned_logprobs.extend(em.logprobs)
        n_bytes = len(em.text.encode())
        self.usage.returned_tokens += len(em.token_ids)
        self.usage.returned_bytes += n_bytes
        self.trace.add("delta", seq=ev.seq, bytes=n_bytes, tokens=len(em.token_ids),
                       held_chars=len(self.pipeline.stop_strings.held), held_ids=len(self.pipeline.stop_ids.held))
        return ev

    def backpressured(self) -> bool:
        """True while the outgoing buffer is full (the request then waits, its state untouched);
        records when a pause starts and ends."""
        if self.buffer is not None and self.buffer.full:
            if self.paused_since is None:
                self.paused_since = time.perf_counter()
                self.trace.add("backpressure.paused", buffered=len(self.buffer))
            return True
        if self.paused_since is not None:
            self.paused_since = None
            self.trace.add("backpressure.resumed")
        return False

    def to_output(self) -> RequestOutput:
        if self.buffer is not None:
            self.timings.send_s = self.buffer.wait_s
        return RequestOutput(
            request_id=self.request_id, prompt_token_ids=list(self.prompt_ids), token_ids=list(self.returned_ids),
            text="".join(self.text_parts), state=self.state, finish_reason=self.finish_reason,
            stop_reason=self.stop_reason, usage=replace(self.usage), error=self.error,
            selected_token_ids=list(self.output_ids),
            logprobs=list(self.returned_logprobs) if self.params.logprobs is not None else None,
            timings=replace(self.timings))

    def mark_released(self, resource: str) -> None:
        """Each resource is released exactly once; a second release is a bug and raises."""
        if resource in self.released:
            raise DoubleReleaseError(f"request {self.request_id}: {resource} released twice")
        self.released.add(resource)
