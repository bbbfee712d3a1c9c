"""Request: one generation's state as the runtime keeps it.

Step state (docs/design.md, "Step state"): with prompt length m and t tokens selected,
    known tokens  = m + t                    (prompt + output)
    num_computed  = tokens whose K/V are in the cache
Between a selection and the next decode, num_computed == m + t - 1: the newest token is chosen
but not yet cached. A step computes known[num_computed : num_computed + n]; when that reaches
the end of the known tokens, its last logits choose token t + 1. Preemption sets num_computed
to 0 (pages gone) and nothing else: the output, seed and decoder state are untouched.

Each field has one writer: the sequence state (`seq`: num_computed, pages, slot, page keys, what
the prefix cache served) is the scheduler's; the delivery record (`delivery`: history, cursors)
is Delivery's. What the client got is not kept twice: text, returned ids and logprobs are read
off the delta events in its delivery record's history (delivery.py), and usage counts are lengths.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from ..errors import DoubleReleaseError
from ..params import SamplingParams
from .output.delivery import DeliveryRecord
from .output.result import Timings
from .lifecycle import FinishReason, RequestState, check_transition
from .output.pipeline import OutputPipeline, TopLogprobs
from .trace import Trace

if TYPE_CHECKING:
    from ..lora.adapter import LoRAAdapter
    from .grammar import GrammarState
    from .spec import PredictionCursor     # annotation only: spec/ imports this module

RESOURCES = ("pages", "slot", "rng", "stream", "trace", "grammar")


@dataclass(eq=False, slots=True)
class SeqState:
    """A request's sequence as the scheduler keeps it: its K/V's pages and slot. Written only by
    the scheduler (scheduler.py, and prefix_cache.py's match / register that it calls); the
    others read it."""
    num_computed: int = 0                 # tokens whose K/V are in its pages (see the top of the file)
    processed_tokens: int = 0             # K/V written for it, recompute included
    pages: list[int] = field(default_factory=list)
    page_keys: list[bytes] = field(default_factory=list)   # chained keys of its full pages so far
    pages_registered: int = 0             # leading pages of `pages` that are in the prefix cache
    cached_tokens: int = 0                # prompt tokens served from the prefix cache
    slot: int | None = None               # its batch slot while it runs
    lora_slot: int | None = None          # its LoRA adapter's slot in the stacks while it runs


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
    seq: SeqState = field(default_factory=SeqState)   # where its K/V is: the scheduler writes it
    cache_namespace: bytes = b""          # prefix cache: model identity + cache_salt
    draft_tokens: int = 0                 # speculation: drafts proposed and verified ...
    accepted_draft_tokens: int = 0        # ... and of them, selected
    grammar: GrammarState | None = None   # its matcher's state when the request is constrained
    prediction: PredictionCursor | None = None   # Predicted Outputs: its drafts' source (prediction.py)
    lora: "LoRAAdapter | None" = None     # the LoRA adapter it runs under (None: the base model)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | tuple[int, ...] | None = None
    error: str | None = None
    cancel_reason: FinishReason = FinishReason.CANCELLED
    timings: Timings = field(default_factory=Timings)
    first_scheduled: float | None = None
    released: set[str] = field(default_factory=set)
    delivery: DeliveryRecord = field(default_factory=DeliveryRecord)   # its events (delivery.py)
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

    def scheduled(self, now: float, decode: bool) -> None:
        """A step is about to compute it (the first time: its queue time ends); decode: its next token."""
        if self.first_scheduled is None:
            self.first_scheduled = now
            self.timings.queue_s = now - self.arrival
        if self.trace.tokens and decode:
            self.trace.token("decode.started", t=len(self.output_ids), cache_len=self.seq.num_computed)

    def computed(self, num_new: int, dt: float) -> None:
        """A step of dt seconds computed num_new of its tokens (the scheduler advanced it)."""
        if self.state == RequestState.DECODING:
            self.timings.decode_s += dt
            if self.trace.tokens:
                self.trace.token("decode.completed", t=len(self.output_ids), cache_len=self.seq.num_computed)
        else:
            self.timings.prefill_s += dt
            if self.trace.tokens:
                self.trace.token("prefill.chunk", tokens=num_new, cache_len=self.seq.num_computed)

    def add_prompt_logprobs(self, first: int, lps: list[float], tops: list[TopLogprobs] | None) -> None:
        """A prefill chunk's prompt logprobs, from prompt token `first` on (they come in order)."""
        if first != len(self.prompt_lps):
            raise RuntimeError(f"prompt logprobs from token {first} computed, but {len(self.prompt_lps)} are known")
        self.prompt_lps.extend(lps)
        self.prompt_tops.extend(tops if tops is not None else [None] * len(lps))
        if self.trace.tokens:
            self.trace.token("prompt_logprobs", first=first, count=len(lps))

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

    def compact(self) -> None:
        """The request ended: drop what only a live request needs. Its params lose the
        constraint (a JSON schema can be megabytes) and the logit bias (up to a vocabulary of
        entries): nothing reads them once it ended."""
        self.pipeline = None
        if self.params.structured_output is not None or self.params.logit_bias is not None:
            self.params = replace(self.params, structured_output=None, logit_bias=None)

    def mark_released(self, resource: str) -> None:
        """Each resource is released exactly once; a second release is a bug and raises."""
        if resource in self.released:
            raise DoubleReleaseError(f"request {self.request_id}: {resource} released twice")
        self.released.add(resource)

    def kept_bytes(self) -> int:
        """An estimate of the memory a finished request keeps: its ids, compact history, trace
        records, stop strings, error and what its caller attached (calibrated with tracemalloc in
        tests/runtime/test_memory.py and tests/server/test_memory_http.py)."""
        ids = ids_bytes(self.prompt_ids) + ids_bytes(self.output_ids)
        texts = sum(len(s) for s in self.params.stop_strings) + len(self.error or "")
        prompt_lps = 0 if self.params.prompt_logprobs is None else len(self.prompt_lps) * (
            32 + 8 + (120 + 90 * self.params.prompt_logprobs if self.params.prompt_logprobs else 0))
        return (BASE_BYTES + ids + self.delivery.kept_bytes() + RECORD_BYTES * len(self.trace.records) + texts
                + prompt_lps)


def ids_bytes(ids: list[int]) -> int:
    """A list of ids: a pointer each, and an int object (32 bytes) for each id above 256
    (Python shares the small ones)."""
    return 8 * len(ids) + 32 * sum(1 for t in ids if t > 256)


BASE_BYTES = 4700      # the Request, its params, timings, trace and id strings
RECORD_BYTES = 310     # one trace record (a small dict)
