"""Constrained decoding with xgrammar: one compiler per engine, compiles off the step loop, a
matcher per request, a per-slot token bitmask.

Life of a constrained request:
    add_request   its size and depth are checked against the limits, its parse and compile are
                  submitted to the worker thread (or found in the bounded cache), and the caller
                  waits, outside the engine's lock, for the parse: an invalid grammar raises
                  InvalidRequestError (the server awaits the parse off its event loop first)
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
import importlib.util
import json
import threading
import time
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..errors import InvalidRequestError
from ..model.tokenizer import TokenizerLike
from ..structured import StructuredOutput
from .finish_rules import is_eos

if TYPE_CHECKING:
    from .config import EngineConfig
    from .request import Request

INSTALL_HINT = "structured output needs xgrammar: pip install 'pagedecode[structured]'"
JSON_WHITESPACE_CAP = 2        # whitespace runs in JSON outputs are bounded


def xgrammar() -> Any:
    try:
        import xgrammar as xgr
    except ImportError:
        raise InvalidRequestError(INSTALL_HINT) from None
    return xgr


def check_installed() -> None:
    """Cheap (no import): a constrained request without xgrammar is refused at once."""
    if importlib.util.find_spec("xgrammar") is None:
        raise InvalidRequestError(INSTALL_HINT)


def check_limits(so: StructuredOutput, max_depth: int, max_bytes: int) -> None:
    """Refuse a constraint whose grammar would take seconds to parse or compile: parsing a JSON
    schema nested 400 deep took 3-5 s (the grammar grows with the square of the depth), a wide
    object of 2,000 properties compiled for 27 s (EngineConfig.max_schema_depth / _bytes)."""
    if so.depth > max_depth:
        raise InvalidRequestError(f"invalid SamplingParams.structured_output: the JSON schema nests {so.depth} "
                                  f"deep, over the limit max_schema_depth={max_depth}")
    if so.size > max_bytes:
        raise InvalidRequestError(f"invalid SamplingParams.structured_output: the {so.kind} constraint is "
                                  f"{so.size} bytes, over the limit max_schema_bytes={max_bytes}")


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


def ebnf_literal(text: str) -> str:
    """text as an EBNF string literal: JSON's escapes, which xgrammar reads (not ASCII-only, so no
    surrogate pairs)."""
    return json.dumps(text, ensure_ascii=False)


def parse(xgr: Any, so: StructuredOutput) -> Any:
    """The xgrammar Grammar of a constraint; InvalidRequestError naming the problem."""
    try:
        if so.kind == "json_schema":
            return xgr.Grammar.from_json_schema(json.dumps(so.json_schema), any_whitespace=False,
                                                strict_mode=True)
        if so.kind == "json_object":             # any object, whitespace as bounded as for a schema
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=True)
        if so.kind == "regex":
            return xgr.Grammar.from_regex(so.regex)
        if so.kind == "ebnf":
            return xgr.Grammar.from_ebnf(so.ebnf)
        assert so.choice is not None             # alternatives of literals (a regex of re.escape()d
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(map(ebnf_literal, so.choice)))   # text warns per escape)
    except InvalidRequestError:
        raise
    except Exception as e:
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        msg = msg.split(": ", 1)[-1] if msg.startswith("[") else msg
        raise InvalidRequestError(f"invalid SamplingParams.structured_output ({so.kind}): {msg}") from None


class CompileJob:
    """One constraint's work in the worker: `parsed` resolves once its grammar is parsed (raises
    InvalidRequestError for an invalid one), `compiled` with the compiled grammar."""

    def __init__(self) -> None:
        self.parsed: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.compiled: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.nbytes = 0                          # the compiled grammar's memory, once known

    def failed(self) -> bool:
        return self.compiled.done() and (self.compiled.cancelled() or self.compiled.exception() is not None)


class GrammarCompiler:
    """One per engine: parses constraints in one worker thread and compiles them in another,
    never on the caller's (compiles wait behind each other; a parse never waits behind one). The first job imports xgrammar and builds the tokenizer's table there (the
    tokenizer's exact bytes, the model's padded vocabulary, the engine's EOS ids as stop tokens).
    xgrammar releases the GIL while it parses and compiles (measured: a 1.3 s parse and a 39 s
    compile left another thread's 1 ms sleeps at most 6 ms late), so a long compile stalls no
    other request. Compiled grammars are cached by constraint, LRU, bounded in count and in bytes
    (CompiledGrammar.memory_size_bytes: a 20,000-option choice keeps 55-130 MB)."""

    def __init__(self, tokenizer: TokenizerLike, vocab_size: int, stop_ids: frozenset[int],
                 cache_size: int = 64, cache_bytes: int = 256 << 20, compile_delay_s: float = 0.0) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        self.xgr: Any = None                     # set in the worker by the first job
        self._compiler: Any = None
        self._parse_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedecode-grammar-parse")
        self._compile_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedecode-grammar")
        self._cache: OrderedDict[str, CompileJob] = OrderedDict()
        self._lock = threading.Lock()
        self.cache_size, self.cache_bytes = cache_size, cache_bytes
        self.compile_delay_s = compile_delay_s      # tests: a deliberately slow compile
        self.compile_s: deque[float] = deque(maxlen=1024)     # the latest compiles' durations

    def submit(self, so: StructuredOutput) -> CompileJob:
        """The constraint's job: cached, or queued for the worker now. Never blocks."""
        with self._lock:
            job = self._cache.get(so.key)
            if job is not None and not job.failed():
                self._cache.move_to_end(so.key)
                return job
            job = self._cache[so.key] = CompileJob()
            self._evict()
        self._parse_pool.submit(self._parse, so, job)
        return job

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            return sum(j.nbytes for j in self._cache.values())

    def _evict(self) -> None:
        """Oldest first, until the count and the bytes fit (a job in flight weighs nothing yet)."""
        total = sum(j.nbytes for j in self._cache.values())
        while self._cache and (len(self._cache) > self.cache_size or total > self.cache_bytes):
            _, old = self._cache.popitem(last=False)
            total -= old.nbytes

    def warm(self) -> concurrent.futures.Future[None] | None:
        """Import xgrammar and build the tokenizer's table in the parse worker now (None without
        xgrammar). The import takes ~2 s (it imports transformers) and holds the GIL for up to
        ~300 ms at a time, in any thread: a server does it at start, before it serves."""
        if importlib.util.find_spec("xgrammar") is None:
            return None
        return self._parse_pool.submit(self._backend)

    def _backend(self) -> None:
        if self._compiler is None:
            self.xgr = xgrammar()
            info = self.xgr.TokenizerInfo(token_bytes_table(self._tokenizer, self.vocab_size), self.xgr.VocabType.RAW,
                                          vocab_size=self.vocab_size, stop_token_ids=self.stop_ids)
            self._compiler = self.xgr.GrammarCompiler(info, max_threads=1)

    def _parse(self, so: StructuredOutput, job: CompileJob) -> None:
        """In the parse worker: a parse waits behind other parses (fast under the schema
        limits), never behind a long compile."""
        if not (job.parsed.set_running_or_notify_cancel() and job.compiled.set_running_or_notify_cancel()):
            return                              # only at shutdown: nothing waits for it
        try:
            self._backend()
            grammar = parse(self.xgr, so)
        except Exception as e:
            job.parsed.set_exception(e)
            job.compiled.set_exception(e)
            return
        job.parsed.set_result(None)
        self._compile_pool.submit(self._compile, grammar, job)

    def _compile(self, grammar: Any, job: CompileJob) -> None:
        t = time.perf_counter()
        try:
            if self.compile_delay_s:
                time.sleep(self.compile_delay_s)
            compiled = self._compiler.compile_grammar(grammar)
        except Exception as e:
            job.compiled.set_exception(e)
            return
        self.compile_s.append(time.perf_counter() - t)
        with self._lock:
            job.nbytes = int(getattr(compiled, "memory_size_bytes", 0))
            self._evict()
        job.compiled.set_result(compiled)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def shutdown(self) -> None:
        self._parse_pool.shutdown(wait=False, cancel_futures=True)
        self._compile_pool.shutdown(wait=False, cancel_futures=True)


class GrammarState:
    """A request's constraint: its compile job, then its matcher."""

    def __init__(self, so: StructuredOutput, job: CompileJob, timeout_s: float) -> None:
        self.spec = so
        self.future = job.compiled
        self.deadline = time.perf_counter() + timeout_s
        self.timeout_s = timeout_s
        self.matcher: Any = None
        self.mask_for: tuple[int, int] | None = None   # (slot, output length) its bitmask row was filled for

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
                 max_depth: int, max_bytes: int) -> None:
        self.eos_ids = sorted(eos_ids)
        self.timeout_s, self.max_depth, self.max_bytes = timeout_s, max_depth, max_bytes
        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos_ids, cache_size=cache_size, cache_bytes=cache_bytes)
        self.bitmask = TokenBitmask(num_slots, vocab_size, device)

    @classmethod
    def from_config(cls, tokenizer: TokenizerLike, vocab_size: int, eos_ids: frozenset[int], device: torch.device,
                    config: EngineConfig) -> "Constraints":
        return cls(tokenizer, vocab_size, eos_ids, config.max_batch_size, device,
                   cache_size=config.grammar_cache_size, cache_bytes=config.grammar_cache_bytes,
                   timeout_s=config.grammar_compile_timeout_s, max_depth=config.max_schema_depth,
                   max_bytes=config.max_schema_bytes)

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
