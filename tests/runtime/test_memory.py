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
