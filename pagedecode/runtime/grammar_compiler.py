"""Parsing and compiling structured-output constraints with xgrammar (one GrammarCompiler per
engine, its work in two worker threads, its results cached), and the checks a constraint passes
before any of that: installed, within the size and depth limits, a valid grammar."""
from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import threading
import time
from collections import OrderedDict, deque
from typing import Any

from ..errors import InvalidRequestError
from ..model.tokenizer import TokenizerLike
from ..structured import StructuredOutput

INSTALL_HINT = "structured output needs xgrammar: pip install 'pagedecode[structured]'"


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
        if so.kind == "structural_tag":
            return xgr.Grammar.from_structural_tag(json.dumps(so.structural_tag))
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
        self.token_bytes: list[bytes] = []       # ... with each id's bytes, as the grammar reads them
        self._compiler: Any = None
        self._parse_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedecode-grammar-parse")
        self._compile_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedecode-grammar")
        self._cache: OrderedDict[str, CompileJob] = OrderedDict()
        self._lock = threading.Lock()
        self.cache_size, self.cache_bytes = cache_size, cache_bytes
        self.compile_delay_s = compile_delay_s      # tests: a deliberately slow compile
        self.compile_s: deque[float] = deque(maxlen=1024)     # the latest compiles' durations
        self._queued = 0                         # jobs submitted to either worker and not yet ended

    def submit(self, so: StructuredOutput) -> CompileJob:
        """The constraint's job: cached, or queued for the worker now. Never blocks."""
        with self._lock:
            job = self._cache.get(so.key)
            if job is not None and not job.failed():
                self._cache.move_to_end(so.key)
                return job
            job = self._cache[so.key] = CompileJob()
            self._evict()
        self._submit(self._parse_pool, self._parse, so, job)
        return job

    def _submit(self, pool: concurrent.futures.ThreadPoolExecutor, fn: Any, *args: Any
                ) -> concurrent.futures.Future[Any]:
        future = pool.submit(fn, *args)
        with self._lock:
            self._queued += 1
        future.add_done_callback(self._ended)        # at once if it has ended already
        return future

    def _ended(self, _: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._queued -= 1

    def busy(self) -> bool:
        """Whether a job is queued or running in either worker (the warm-up's import, a parse, a
        compile). Neither can be stopped, and the interpreter's exit joins both workers: `serve`
        asks this to end at once after its drain instead of waiting for them."""
        with self._lock:
            return self._queued > 0

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
        return self._submit(self._parse_pool, self._backend)

    def _backend(self) -> None:
        if self._compiler is None:
            self.xgr = xgrammar()
            self.token_bytes = token_bytes_table(self._tokenizer, self.vocab_size)
            info = self.xgr.TokenizerInfo(self.token_bytes, self.xgr.VocabType.RAW,
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
        self._submit(self._compile_pool, self._compile, grammar, job)

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
