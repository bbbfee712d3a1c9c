"""Bounded memory on a long-running server: what a finished request keeps, per trace level,
is measured (tracemalloc) and matches the estimate the byte budget uses; the budget holds;
a forgotten request says so."""
import gc
import tracemalloc

import pytest

import pagedecode as pd

from .helpers import engine, run


def kept_per_request(level, n=40, tokens=256):
    eng = engine([101, 102, 103], trace=level, max_batch_size=n, max_cache_tokens=n * (tokens + 8))
    first = eng.generate([[5]], pd.SamplingParams(max_tokens=4))[0].request_id
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    outs = eng.generate([[5, 6, 5]] * n, pd.SamplingParams(max_tokens=tokens))
    del outs
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return used / n, (eng.requests.finished_bytes - eng.requests.get(first).kept_bytes()) / n


@pytest.mark.parametrize("level, most", [("off", 16_000), ("lifecycle", 21_000), ("tokens", 420_000)])
def test_bytes_kept_per_finished_request(level, most):
    measured, estimated = kept_per_request(level)
    assert measured < most                       # a 256-token request used to keep ~390 KB
    assert 0.75 < estimated / measured < 1.33    # the budget's estimate is honest


def test_finished_byte_budget_drops_the_oldest_and_says_so():
    eng = engine([101], max_finished_bytes=60_000, trace="lifecycle")
    rids = [eng.add_request([5], pd.SamplingParams(max_tokens=32)) for _ in range(12)]
    run(eng)
    assert eng.requests.finished_bytes <= 60_000
    kept = [r for r in rids if r in eng.requests._finished]
    assert kept == rids[len(rids) - len(kept):] and 1 <= len(kept) < len(rids)    # oldest dropped first
    with pytest.raises(pd.ForgottenRequestError, match="forgotten to bound memory"):
        eng.replay(rids[0])
    with pytest.raises(KeyError, match="unknown request id"):
        eng.replay("never-existed")
    assert eng.result(rids[-1]).text == "AB" * 32
    assert [e.seq for e in eng.replay(rids[-1])] == list(range(34))    # replay rebuilt from the compact form


def test_trace_levels():
    for level, kinds in (("off", set()), ("lifecycle", {"state", "release", "finish", "added"}),
                         ("tokens", {"token.selected", "decode.completed", "delta", "state"})):
        eng = engine([101], trace=level)
        rid = eng.add_request([5], pd.SamplingParams(max_tokens=3))
        run(eng)
        got = {r["kind"] for r in eng.trace(rid)}
        assert kinds <= got and (level == "tokens" or "token.selected" not in got)
        assert level != "off" or not got
    with pytest.raises(ValueError, match="trace"):
        pd.EngineConfig(trace="verbose")


def test_a_finished_request_keeps_neither_its_schema_nor_its_bias(stories_engine_factory):
    """A 900 KB schema description was kept twice (the schema and the cache key) by every
    finished request, uncounted; a logit bias up to a vocabulary of entries likewise."""
    pytest.importorskip("xgrammar")
    # one compiled grammar kept (the cache is bounded on its own), so only what requests keep is measured
    eng = stories_engine_factory(trace="lifecycle", max_schema_bytes=2 << 20, grammar_cache_size=1)

    def constrained(i):
        schema = {"type": "object", "description": "d" * 900_000 + str(i), "properties": {"a": {"type": "integer"}}}
        return pd.SamplingParams(max_tokens=2, logit_bias={t: 0.5 for t in range(300, 500)},
                                 structured_output=pd.StructuredOutput(json_schema=schema))
    eng.generate(["Once"], constrained(0))
    gc.collect()
    tracemalloc.start()
    before, kept_before = tracemalloc.get_traced_memory()[0], eng.requests.finished_bytes
    for i in range(1, 9):
        eng.generate(["Once"], constrained(i))
    gc.collect()
    used = (tracemalloc.get_traced_memory()[0] - before) / 8
    tracemalloc.stop()
    estimated = (eng.requests.finished_bytes - kept_before) / 8
    assert used < 30_000, used
    assert 0.7 < estimated / used < 1.4, (estimated, used)
    req = eng.requests.get(next(reversed(eng.requests._finished)))
    assert req.params.structured_output is None and req.params.logit_bias is None and req.params.max_tokens == 2
    assert all(len(k) < 80 for k in eng.constraints.compiler._cache)          # the compile cache keys by a digest


def test_ids_above_256_are_counted_as_the_objects_they_are():
    eng = engine(lambda p, o: 4000 + len(o), vocab_size=5000, trace="off", max_cache_tokens=20_000,
                 enable_prefix_caching=False)           # its page registry is the pool's, bounded by it
    eng.generate([[5]], pd.SamplingParams(max_tokens=4))
    gc.collect()
    tracemalloc.start()
    before, kept_before = tracemalloc.get_traced_memory()[0], eng.requests.finished_bytes
    eng.generate([[1000 + (7 * t + k) % 3000 for t in range(2000)] for k in range(4)],   # fresh int objects
                 pd.SamplingParams(max_tokens=200))
    gc.collect()
    used = (tracemalloc.get_traced_memory()[0] - before) / 4
    tracemalloc.stop()
    estimated = (eng.requests.finished_bytes - kept_before) / 4
    assert 0.75 < estimated / used < 1.33, (estimated, used)
