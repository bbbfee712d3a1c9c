"""Constrained decoding with xgrammar: a matcher per request, a per-slot token bitmask, and what a
step does with them (the compiler, which works off the step loop: grammar_compiler.py).

Life of a constrained request:
    add_request   its size and depth are checked against the limits, its parse and compile are
                  submitted to the worker thread (or found in the bounded cache), and the caller
                  waits, outside the engine's lock, for the parse: an invalid grammar raises
                  InvalidRequestError (the server awaits the parse off its event loop first)
    QUEUED        not schedulable until the compile is done (cancels and deadlines still apply);
                  a failed or timed-out compile fails the request
    each step     its slot's bitmask row is filled (at most once per token) and applied to its
                  logits before sampling; a row left with no allowed token fails the request
    tool calls    near the end of the budget, a selected token that would leave the call unable to
                  finish in time is replaced by the way to finish it (grammar_close.py)
    commit        the chosen token is accepted by the matcher (a refusal is a bug: the request
                  fails naming the token); grammar_complete when the matcher accepts a stop token
                  (EOS) or allows nothing but stop tokens next (must end), without another forward
"""
from __future__ import annotations

import concurrent.futures
import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..errors import InvalidRequestError
from ..model.tokenizer import TokenizerLike
from ..structured import StructuredOutput
from .finish_rules import is_eos
from .grammar_close import Closer, CloseWatch
from .grammar_compiler import CompileJob, GrammarCompiler, check_installed, check_limits

if TYPE_CHECKING:
    from .config import EngineConfig
    from .request import Request


class GrammarState:
    """A request's constraint: its compile job, then its matcher."""

    def __init__(self, so: StructuredOutput, job: CompileJob, timeout_s: float) -> None:
        self.spec = so
        self.future = job.compiled
        self.deadline = time.perf_counter() + timeout_s
        self.timeout_s = timeout_s
        self.matcher: Any = None
        self.mask_for: tuple[int, int] | None = None   # (slot, output length) its bitmask row was filled for
        self.close = None if so.close_after is None else CloseWatch(tuple(a.encode() for a in so.close_after))

    def ready(self, make_matcher: Callable[[Any], Any]) -> bool:
        if self.matcher is not None:
            return True
        if not self.future.done() or self.future.exception() is not None:
            return False
        self.matcher = make_matcher(self.future.result())
        return True

    def failure(self) -> str | None:
        """Why the compile can never be used (None while it may still finish). A compile past
        its time is left to finish in the worker (another request may share it; xgrammar
        cannot be interrupted), bounded by the schema limits."""
        if self.matcher is not None:
            return None
        if self.future.done():
            exc = self.future.exception()
            return None if exc is None else f"grammar compilation failed: {exc}"
        if time.perf_counter() > self.deadline:
            return f"grammar compilation took longer than {self.timeout_s}s"
        return None


class TokenBitmask:
    """A bitmask row per batch slot (pinned host memory on CUDA), applied to logits rows."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.host = torch.full((num_slots, -(-vocab_size // 32)), -1, dtype=torch.int32)   # (slots, ceil(V / 32))
        if device.type == "cuda":
            self.host = self.host.pin_memory()
        self.device = device

    def fill(self, matcher: Any, slot: int) -> None:
        matcher.fill_next_token_bitmask(self.host, slot)

    def only_stop_tokens(self, slot: int, stop_ids: list[int]) -> bool:
        """True when the row allows nothing but stop tokens (the grammar must end)."""
        row = self.host[slot].clone()
        for t in stop_ids:
            row[t // 32] &= ~(1 << (t % 32))
        return not bool(row.any())

    def rows(self, slots: list[int | None]) -> torch.Tensor:
        """(N, W) int32 on the engine's device: the slot's row, or every bit set (None)."""
        out = torch.full((len(slots), self.host.shape[1]), -1, dtype=torch.int32)
        for i, slot in enumerate(slots):
            if slot is not None:
                out[i] = self.host[slot]
        if self.device.type == "cuda":
            out = out.pin_memory()
        return out.to(self.device, non_blocking=True)


class Constraints:
    """The engine's structured-output side: the compiler (its worker starts with the first
    constrained request), the per-slot bitmask, and what a step does with a request's matcher."""

    def __init__(self, tokenizer: TokenizerLike, vocab_size: int, eos_ids: frozenset[int], num_slots: int,
                 device: torch.device, *, cache_size: int, cache_bytes: int, timeout_s: float,
                 max_depth: int, max_bytes: int, max_context: int) -> None:
        self.eos_ids = sorted(eos_ids)
        self.vocab_size, self.max_context = vocab_size, max_context
        self._closer: Closer | None = None
        self.timeout_s, self.max_depth, self.max_bytes = timeout_s, max_depth, max_bytes
        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos_ids, cache_size=cache_size, cache_bytes=cache_bytes)
        self.bitmask = TokenBitmask(num_slots, vocab_size, device)

    @classmethod
    def from_config(cls, tokenizer: TokenizerLike, vocab_size: int, eos_ids: frozenset[int], device: torch.device,
                    config: EngineConfig, max_context: int) -> "Constraints":
        return cls(tokenizer, vocab_size, eos_ids, config.max_batch_size, device,
                   cache_size=config.grammar_cache_size, cache_bytes=config.grammar_cache_bytes,
                   timeout_s=config.grammar_compile_timeout_s, max_depth=config.max_schema_depth,
                   max_bytes=config.max_schema_bytes, max_context=max_context)

    def prepare(self, so: StructuredOutput) -> CompileJob:
        """Check the constraint's limits (InvalidRequestError naming them) and start its parse and
        compile in the worker; cheap and thread-safe, never under the engine's lock by need."""
        check_installed()
        check_limits(so, self.max_depth, self.max_bytes)
        return self.compiler.submit(so)

    def wait_parsed(self, job: CompileJob) -> None:
        """Block the calling thread (not the step loop) until the grammar is parsed: an invalid
        one raises InvalidRequestError here, a parse over grammar_compile_timeout_s too."""
        try:
            job.parsed.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise InvalidRequestError(f"invalid SamplingParams.structured_output: parsing the grammar took longer "
                                      f"than grammar_compile_timeout_s={self.timeout_s}s") from None

    def attach(self, so: StructuredOutput, job: CompileJob) -> GrammarState:
        """A new request's constraint (its job prepared): the request waits for the compile in QUEUED."""
        return GrammarState(so, job, self.timeout_s)

    def ready(self, g: GrammarState) -> bool:
        return g.ready(self.compiler.matcher)

    def rows(self, grammars: list[GrammarState | None], slots: list[int | None], lengths: list[int]
             ) -> torch.Tensor | None:
        """This step's bitmask rows (all allowed for unconstrained rows); a slot's row is filled
        at most once per token (must_end may have filled it already)."""
        if all(g is None for g in grammars):
            return None
        for g, slot, n in zip(grammars, slots, lengths):
            if g is not None:
                assert slot is not None and g.matcher is not None
                if g.mask_for != (slot, n):
                    self.bitmask.fill(g.matcher, slot)
                    g.mask_for = (slot, n)
        return self.bitmask.rows([s if g is not None else None for g, s in zip(grammars, slots)])

    def close_in_budget(self, reqs: list[Request], tokens: list[int], skip: frozenset[int]) -> dict[int, int]:
        """The rows whose selected token would leave a watched tool call unable to finish within
        its request's budget, each with the token to select instead (grammar_close.py); rows in
        `skip` (bad or empty) are left alone. Cheap until a watch is due."""
        out: dict[int, int] = {}
        for i, req in enumerate(reqs):
            g = req.grammar
            if g is None or g.close is None or i in skip or len(req.output_ids) < g.close.check_at:
                continue
            if self._closer is None:
                c = self.compiler
                self._closer = Closer(c.token_bytes, c.stop_ids, self.vocab_size)
            t = len(req.output_ids)
            budget = min(req.params.max_tokens - t, self.max_context - req.num_tokens)
            token = self._closer.check(g.close, g.matcher, req.output_ids, tokens[i], budget)
            if token is not None:
                out[i] = token
                req.trace.add("grammar.closing", t=t + 1, selected=tokens[i], token=token, budget=budget)
        return out

    def accept(self, g: GrammarState, token: int) -> bool:
        """The matcher takes the committed token; True when it accepted a stop token. A refused
        token is a bug (the mask allowed it) and raises."""
        if not g.matcher.accept_token(token):
            raise RuntimeError(f"the grammar rejected token {token} (a bug: the mask allowed it)")
        return bool(g.matcher.is_terminated())

    def must_end(self, g: GrammarState, slot: int, n_tokens: int) -> bool:
        """Fill the next mask now (the next step reuses it): nothing but stop tokens allowed
        means the grammar is complete, without another forward pass."""
        self.bitmask.fill(g.matcher, slot)
        g.mask_for = (slot, n_tokens)
        return self.bitmask.only_stop_tokens(slot, self.eos_ids)

    def take(self, req: Request, token: int) -> bool:
        """The request's matcher takes its committed token (before the token's text is sent);
        True when it accepted a stop token: the grammar is complete."""
        if req.grammar is None:
            return False
        try:
            done = self.accept(req.grammar, token)
        except RuntimeError:
            req.trace.add("grammar.rejected", token=token)
            raise
        if done:
            req.trace.add("grammar.terminated", token=token)
            return True
        if req.trace.tokens:
            req.trace.token("grammar.accepted", token=token)
        return False

    def ends_after(self, req: Request, token: int, eos_ids: frozenset[int]) -> bool:
        """The grammar allows nothing but stop tokens after `token`: complete without another forward."""
        if req.grammar is None or is_eos(req, token, eos_ids):
            return False
        assert req.seq.slot is not None
        if self.must_end(req.grammar, req.seq.slot, len(req.output_ids)):
            req.trace.add("grammar.terminated", must_end=True)
            return True
        return False
