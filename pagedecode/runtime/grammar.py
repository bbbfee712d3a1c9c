"""Constrained decoding with xgrammar: one compiler per engine, compiles off the step loop, a
matcher per request, a per-slot token bitmask.

Life of a constrained request:
    add_request   the grammar is parsed (an invalid one raises InvalidRequestError) and its
                  compile is submitted to a worker thread (or found in the bounded cache)
    QUEUED        not schedulable until the compile is done (cancels and deadlines still apply);
                  a failed or timed-out compile fails the request
    each step     its slot's bitmask row is filled (at most once per token) and applied to its
                  logits before sampling; a row left with no allowed token fails the request
    commit        the chosen token is accepted by the matcher (a refusal is a bug: the request
                  fails naming the token); grammar_complete when the matcher accepts a stop token
                  (EOS) or allows nothing but stop tokens next (must end), without another forward
"""
from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import OrderedDict
from typing import Any, Callable

import torch

from ..errors import InvalidRequestError
from ..model.tokenizer import TokenizerLike
from ..structured import StructuredOutput

INSTALL_HINT = "structured output needs xgrammar: pip install 'pagedecode[structured]'"
JSON_WHITESPACE_CAP = 2        # whitespace runs in JSON outputs are bounded


def xgrammar() -> Any:
    try:
        import xgrammar as xgr
    except ImportError:
        raise InvalidRequestError(INSTALL_HINT) from None
    return xgr


def token_bytes_table(tokenizer: TokenizerLike, vocab_size: int) -> list[bytes]:
    """Each id's exact bytes as it reads inside a text (empty for specials and padded ids)."""
    out = []
    pieces = tokenizer.byte_pieces
    for i in range(vocab_size):
        if not tokenizer.is_shown(i, True):
            out.append(b"")
            continue
        byte = tokenizer.byte_fallback_value(i)
        if byte is not None:
            out.append(bytes([byte]))
        elif pieces is not None:
            out.append(pieces.token_bytes(i, False))
        else:
            out.append(tokenizer.decode([i], True).encode())
    return out


def parse(xgr: Any, so: StructuredOutput) -> Any:
    """The xgrammar Grammar of a constraint; InvalidRequestError naming the problem."""
    try:
        if so.kind == "json_schema":
            import json
            return xgr.Grammar.from_json_schema(json.dumps(so.json_schema), any_whitespace=False,
                                                strict_mode=True)
        if so.kind == "json_object":             # any object, whitespace as bounded as for a schema
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=True)
        if so.kind == "regex":
            return xgr.Grammar.from_regex(so.regex)
        if so.kind == "ebnf":
            return xgr.Grammar.from_ebnf(so.ebnf)
        assert so.choice is not None
        import re
        return xgr.Grammar.from_regex("|".join(f"(?:{re.escape(c)})" for c in so.choice))
    except InvalidRequestError:
        raise
    except Exception as e:
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        msg = msg.split(": ", 1)[-1] if msg.startswith("[") else msg
        raise InvalidRequestError(f"invalid SamplingParams.structured_output ({so.kind}): {msg}") from None


class GrammarCompiler:
    """One per engine: the tokenizer's exact bytes, the model's padded vocabulary, the engine's
    EOS ids as stop tokens; compiles in a worker thread with a bounded cache keyed by the
    constraint."""

    def __init__(self, tokenizer: TokenizerLike, vocab_size: int, stop_ids: frozenset[int],
                 cache_size: int = 64, compile_delay_s: float = 0.0) -> None:
        self.xgr = xgrammar()
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        info = self.xgr.TokenizerInfo(token_bytes_table(tokenizer, vocab_size), self.xgr.VocabType.RAW,
                                      vocab_size=vocab_size, stop_token_ids=self.stop_ids)
        self._compiler = self.xgr.GrammarCompiler(info, max_threads=1)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedecode-grammar")
        self._cache: OrderedDict[str, concurrent.futures.Future[Any]] = OrderedDict()
        self._lock = threading.Lock()
        self.cache_size = cache_size
        self.compile_delay_s = compile_delay_s      # tests: a deliberately slow compile
        self.compile_s: list[float] = []

    def submit(self, so: StructuredOutput) -> concurrent.futures.Future[Any]:
        grammar = parse(self.xgr, so)               # raises now for an invalid constraint
        with self._lock:
            fut = self._cache.get(so.key)
            if fut is not None and not (fut.done() and fut.exception() is not None):
                self._cache.move_to_end(so.key)
                return fut
            fut = self._pool.submit(self._compile, grammar)
            self._cache[so.key] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return fut

    def _compile(self, grammar: Any) -> Any:
        t = time.perf_counter()
        if self.compile_delay_s:
            time.sleep(self.compile_delay_s)
        compiled = self._compiler.compile_grammar(grammar)
        self.compile_s.append(time.perf_counter() - t)
        return compiled

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarState:
    """A request's constraint: its compile, then its matcher."""

    def __init__(self, so: StructuredOutput, future: concurrent.futures.Future[Any], timeout_s: float) -> None:
        self.spec = so
        self.future = future
        self.deadline = time.perf_counter() + timeout_s
        self.timeout_s = timeout_s
        self.matcher: Any = None
        self.mask_for: tuple[int, int] | None = None   # (slot, output length) its bitmask row was filled for

    def ready(self, make_matcher: Callable[[Any], Any]) -> bool:
        if self.matcher is not None:
            return True
        if not self.future.done():
            return False
        self.matcher = make_matcher(self.future.result())
        return True

    def failure(self) -> str | None:
        """Why the compile can never be used (None while it may still finish)."""
        if self.matcher is not None:
            return None
        if self.future.done():
            exc = self.future.exception()
            return None if exc is None else f"grammar compilation failed: {exc}"
        if time.perf_counter() > self.deadline:
            self.future.cancel()
            return f"grammar compilation took longer than {self.timeout_s}s"
        return None


class TokenBitmask:
    """A bitmask row per batch slot (pinned host memory on CUDA), applied to logits rows."""

    def __init__(self, xgr: Any, num_slots: int, vocab_size: int, device: torch.device) -> None:
        self.xgr = xgr
        self.vocab_size = vocab_size
        self.host = xgr.allocate_token_bitmask(num_slots, vocab_size)        # (slots, ceil(V / 32)) int32
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
    """The engine's structured-output side, made on the first constrained request: the
    compiler, the per-slot bitmask, and what a step does with a request's matcher."""

    def __init__(self, tokenizer: TokenizerLike, vocab_size: int, eos_ids: frozenset[int], num_slots: int,
                 device: torch.device, cache_size: int, timeout_s: float) -> None:
        self._tokenizer, self._vocab_size, self._num_slots, self._device = tokenizer, vocab_size, num_slots, device
        self.eos_ids = sorted(eos_ids)
        self._stop_set = eos_ids
        self.cache_size, self.timeout_s = cache_size, timeout_s
        self.compiler: GrammarCompiler | None = None
        self.bitmask: TokenBitmask | None = None

    def attach(self, so: StructuredOutput) -> GrammarState:
        """A new request's constraint: parsed now (InvalidRequestError), compiled off the loop."""
        if self.compiler is None:
            self.compiler = GrammarCompiler(self._tokenizer, self._vocab_size, self._stop_set,
                                            cache_size=self.cache_size)
            self.bitmask = TokenBitmask(self.compiler.xgr, self._num_slots, self._vocab_size, self._device)
        return GrammarState(so, self.compiler.submit(so), self.timeout_s)

    def ready(self, g: GrammarState) -> bool:
        assert self.compiler is not None
        return g.ready(self.compiler.matcher)

    def rows(self, grammars: list[GrammarState | None], slots: list[int | None], lengths: list[int]
             ) -> torch.Tensor | None:
        """This step's bitmask rows (all allowed for unconstrained rows); a slot's row is filled
        at most once per token (must_end may have filled it already)."""
        if self.bitmask is None or all(g is None for g in grammars):
            return None
        for g, slot, n in zip(grammars, slots, lengths):
            if g is not None:
                assert slot is not None and g.matcher is not None
                if g.mask_for != (slot, n):
                    self.bitmask.fill(g.matcher, slot)
                    g.mask_for = (slot, n)
        return self.bitmask.rows([s if g is not None else None for g, s in zip(grammars, slots)])

    def accept(self, g: GrammarState, token: int) -> bool:
        """The matcher takes the committed token; True when it accepted a stop token. A refused
        token is a bug (the mask allowed it) and raises."""
        if not g.matcher.accept_token(token):
            raise RuntimeError(f"the grammar rejected token {token} (a bug: the mask allowed it)")
        return bool(g.matcher.is_terminated())

    def must_end(self, g: GrammarState, slot: int, n_tokens: int) -> bool:
        """Fill the next mask now (the next step reuses it): nothing but stop tokens allowed
        means the grammar is complete, without another forward pass."""
        assert self.bitmask is not None
        self.bitmask.fill(g.matcher, slot)
        g.mask_for = (slot, n_tokens)
        return self.bitmask.only_stop_tokens(slot, self.eos_ids)
