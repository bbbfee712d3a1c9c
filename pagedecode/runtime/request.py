"""Request: one generation's state as the runtime keeps it.

Step state (DESIGN.md, "the off-by-one"): with prompt length m and t tokens selected,
    known tokens  = m + t                    (prompt + output)
    num_computed  = tokens whose K/V are in the cache
Between a selection and the next decode, num_computed == m + t - 1: the newest token is chosen
but not yet cached. A step computes known[num_computed : num_computed + n]; when that reaches
the end of the known tokens, its last logits choose token t + 1. Preemption sets num_computed
to 0 (pages gone) and nothing else: the output, seed and decoder state are untouched.

What the client got is not kept twice: text, returned ids and logprobs are read off the delta
events in `history`, and usage counts are lengths.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from ..errors import DoubleReleaseError
from ..params import SamplingParams
from .events import DeltaEvent, Event, RequestOutput, Timings, Usage
from .history import CompactHistory
from .lifecycle import FinishReason, RequestState, check_transition
from .output import Emission, OutputPipeline, TopLogprobs
from .stream import EventBuffer
from .trace import Trace

RESOURCES = ("pages", "slot", "rng", "stream", "trace", "grammar")


class Attachment(Protocol):
    """What a caller keeps with a request (the server's Track): it lives exactly as long as the
    engine keeps the request, and its bytes count against the finished budget."""

    def kept_bytes(self) -> int: ...


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: float
    pipeline: OutputPipeline | None       # None once terminal (its decoder state is dropped)
    trace: Trace
    deadline: float | None = None
    first_token_deadline: float | None = None
    state: RequestState = RequestState.CREATED
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    processed_tokens: int = 0             # K/V written for it, recompute included
    pages: list[int] = field(default_factory=list)
    cache_namespace: bytes = b""          # prefix cache: model identity + cache_salt
    page_keys: list[bytes] = field(default_factory=list)   # chained keys of its full pages so far
    pages_registered: int = 0             # leading pages of `pages` that are in the prefix cache
    cached_tokens: int = 0                # prompt tokens served from the prefix cache
    grammar: Any = None                   # a GrammarState when the request is constrained
    slot: int | None = None
    next_seq: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | tuple[int, ...] | None = None
    error: str | None = None
    cancel_reason: FinishReason = FinishReason.CANCELLED
    buffer: EventBuffer | None = None     # set when a consumer reads events itself (streaming)
    acked_seq: int | None = None          # or: a consumer reads the history and acks up to here
    max_unacked: int = 0                  # ... and the request pauses with this many events unread
    paused_since: float | None = None     # backpressure: buffer full since
    history: list[Event] | CompactHistory = field(default_factory=list)   # compacted when it ends
    timings: Timings = field(default_factory=Timings)
    first_scheduled: float | None = None
    released: set[str] = field(default_factory=set)
    attachment: Attachment | None = None
    pins: int = 0                         # consumers that will read it: it is not forgotten meanwhile
    # prompt_logprobs: entry j is prompt token j's logprob (None for the first), filled in order as
    # prefill chunks compute them; a recompute after preemption does not compute them again
    prompt_lps: list[float | None] = field(default_factory=lambda: [None])
    prompt_tops: list[TopLogprobs | None] = field(default_factory=lambda: [None])

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def prompt_logprob_positions(self, start: int, n: int) -> range:
        """The positions among start : start + n whose logits give a prompt token's logprob that
        it still needs (position p's logits score prompt token p + 1)."""
        if self.params.prompt_logprobs is None:
            return range(0)
        return range(max(start, len(self.prompt_lps) - 1), min(start + n, len(self.prompt_ids) - 1))

    @property
    def needs_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and len(self.prompt_lps) < len(self.prompt_ids)

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

    def deltas(self) -> list[DeltaEvent]:
        if isinstance(self.history, CompactHistory):
            return self.history.deltas()
        return [e for e in self.history if isinstance(e, DeltaEvent)]

    def compact(self) -> None:
        """The request ended: keep only what results and replay need, compactly. Its params
        lose the constraint (a JSON schema can be megabytes) and the logit bias (up to a vocabulary
        of entries): nothing reads them once it ended."""
        if isinstance(self.history, list):
            self.history = CompactHistory(self.history)
        self.pipeline = None
        self.page_keys = []
        if self.params.structured_output is not None or self.params.logit_bias is not None:
            self.params = replace(self.params, structured_output=None, logit_bias=None)

    def usage(self) -> Usage:
        if isinstance(self.history, CompactHistory) and self.history.terminal is not None:
            return replace(self.history.terminal.usage)
        deltas = self.deltas()
        return Usage(prompt_tokens=len(self.prompt_ids), selected_tokens=len(self.output_ids),
                     processed_tokens=self.processed_tokens, cached_tokens=self.cached_tokens,
                     returned_tokens=sum(len(d.token_ids) for d in deltas),
                     returned_bytes=sum(len(d.text.encode()) for d in deltas))

    def delta(self, em: Emission) -> DeltaEvent:
        lps = em.logprobs if self.params.logprobs is not None else None
        top = em.top_logprobs if self.params.logprobs else None
        ev = DeltaEvent(self.request_id, self.take_seq(), em.text, em.token_ids, lps, top)
        if self.trace.tokens and self.pipeline is not None:
            self.trace.token("delta", seq=ev.seq, bytes=len(em.text.encode()), tokens=len(em.token_ids),
                             held_chars=self.pipeline.held_chars, held_ids=self.pipeline.stop_ids.held)
        return ev

    def backpressured(self) -> bool:
        """True while the outgoing buffer is full (the request then waits, its state untouched);
        records when a pause starts and ends."""
        if (self.buffer is not None and self.buffer.full) or (
                self.acked_seq is not None and self.next_seq - 1 - self.acked_seq >= self.max_unacked):
            if self.paused_since is None:
                self.paused_since = time.perf_counter()
                unread = len(self.buffer) if self.buffer is not None else self.next_seq - 1 - (self.acked_seq or 0)
                self.trace.add("backpressure.paused", unread=unread)
            return True
        if self.paused_since is not None:
            self.paused_since = None
            self.trace.add("backpressure.resumed")
        return False

    def to_output(self) -> RequestOutput:
        if self.buffer is not None:
            self.timings.send_s = self.buffer.wait_s
        logprobs = top = None
        if isinstance(self.history, CompactHistory):        # an ended request: read the packed arrays
            h = self.history
            text, ids = h.text, h.token_ids
            if self.params.logprobs is not None:
                logprobs = h.logprobs or []
            if self.params.logprobs:
                top = h.top_logprobs or []
        else:
            deltas = self.deltas()
            text, ids = "".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids]
            if self.params.logprobs is not None:
                logprobs = [lp for d in deltas for lp in (d.logprobs or ())]
            if self.params.logprobs:
                top = [t for d in deltas for t in (d.top_logprobs or ())]
        return RequestOutput(
            request_id=self.request_id, prompt_token_ids=list(self.prompt_ids),
            token_ids=ids, text=text,
            state=self.state, finish_reason=self.finish_reason, stop_reason=self.stop_reason,
            usage=self.usage(), error=self.error, selected_token_ids=list(self.output_ids),
            logprobs=logprobs, top_logprobs=top, timings=Timings(**vars(self.timings)),
            prompt_logprobs=None if self.params.prompt_logprobs is None else list(self.prompt_lps),
            prompt_top_logprobs=list(self.prompt_tops) if self.params.prompt_logprobs else None)

    def mark_released(self, resource: str) -> None:
        """Each resource is released exactly once; a second release is a bug and raises."""
        if resource in self.released:
            raise DoubleReleaseError(f"request {self.request_id}: {resource} released twice")
        self.released.add(resource)

    def kept_bytes(self) -> int:
        """An estimate of the memory a finished request keeps: its ids, compact history, trace
        records, stop strings, error and what its caller attached (calibrated with tracemalloc in
        tests/runtime/test_memory.py and tests/server/test_memory_http.py)."""
        history = self.history.kept_bytes() if isinstance(self.history, CompactHistory) else 230 * len(self.history)
        ids = ids_bytes(self.prompt_ids) + ids_bytes(self.output_ids)
        texts = sum(len(s) for s in self.params.stop_strings) + len(self.error or "")
        attached = 0 if self.attachment is None else self.attachment.kept_bytes()
        prompt_lps = 0 if self.params.prompt_logprobs is None else len(self.prompt_lps) * (
            32 + 8 + (120 + 90 * self.params.prompt_logprobs if self.params.prompt_logprobs else 0))
        return BASE_BYTES + ids + history + RECORD_BYTES * len(self.trace.records) + texts + attached + prompt_lps


def ids_bytes(ids: list[int]) -> int:
    """A list of ids: a pointer each, and an int object (32 bytes) for each id above 256
    (Python shares the small ones)."""
    return 8 * len(ids) + 32 * sum(1 for t in ids if t > 256)


BASE_BYTES = 4700      # the Request, its params, timings, trace and id strings
RECORD_BYTES = 310     # one trace record (a small dict)
