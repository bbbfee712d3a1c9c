"""Engine.snapshot(): the public, frozen record of requests, pages, slots and counters that outer
layers (the server's /metrics) read instead of the engine's internals."""
import dataclasses
import threading
import time

import pytest

import pagedecode as pd

from .helpers import engine, run

S = pd.RequestState


def counts(snap):
    return {f.name: getattr(snap, f.name) for f in dataclasses.fields(snap)}


def test_a_known_workload_step_by_step():
    # 8 pages of 4 tokens, 2 slots; 3 requests of 6 prompt tokens and 3 output tokens each
    eng = engine([101], page_size=4, max_cache_tokens=32, max_batch_size=2, enable_prefix_caching=False)
    params = pd.SamplingParams(max_tokens=3, ignore_eos=True)
    rids = [eng.add_request([5] * 6, params) for _ in range(3)]
    assert counts(eng.snapshot()) == dict(
        running=0, waiting=3, paused=0, finished_kept=0, pages_used=0, pages_cached=0, pages_total=8,
        slots_used=0, slots_total=2, preemptions=0, prefix_cache_queries=0, prefix_cache_hits=0, steps=0,
        prompt_tokens=18, generated_tokens=0, spec_decode_num_drafts=0, spec_decode_num_draft_tokens=0,
        spec_decode_num_accepted_tokens=0)
    eng.step()              # two admitted: 6 tokens each in 2 pages, each chooses its first token
    s = eng.snapshot()
    assert (s.running, s.waiting, s.slots_used, s.pages_used, s.steps, s.generated_tokens) == (2, 1, 2, 4, 1, 2)
    assert s.kv_cache_usage == 4 / 8
    eng.step()
    eng.step()              # 8 tokens computed, the third output token chosen: both finish
    s = eng.snapshot()
    assert (s.running, s.waiting, s.slots_used, s.pages_used, s.finished_kept) == (0, 1, 0, 0, 2)
    assert (s.steps, s.generated_tokens) == (3, 6)
    run(eng)
    s = eng.snapshot()
    assert [eng.result(r).state for r in rids] == [S.FINISHED] * 3
    assert (s.running, s.waiting, s.pages_used, s.finished_kept, s.steps, s.generated_tokens) == (0, 0, 0, 3, 6, 9)
    assert s.preemptions == 0 and s.prompt_tokens == 18


def test_the_snapshot_is_frozen_and_does_not_follow_the_engine():
    eng = engine([101], page_size=4)
    before = eng.snapshot()
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.running = 5
    eng.add_request([5] * 3, pd.SamplingParams(max_tokens=2))
    assert before.waiting == 0 and eng.snapshot().waiting == 1
    assert isinstance(before, pd.EngineSnapshot)


def test_preemptions_under_a_tiny_pool_match_the_traces():
    # 4 pages of 4 tokens; two requests growing to 13 tokens (4 pages) each cannot both run
    eng = engine([101], page_size=4, max_cache_tokens=16, max_batch_size=4, enable_prefix_caching=False)
    rids = [eng.add_request([5 + i] * 3, pd.SamplingParams(max_tokens=10, ignore_eos=True)) for i in range(2)]
    run(eng)
    traced = sum(r["kind"] == "preempted" for rid in rids for r in eng.trace(rid))
    s = eng.snapshot()
    assert traced > 0 and s.preemptions == traced
    assert s.generated_tokens == 20 and s.pages_used == 0 and s.slots_used == 0


def test_a_paused_consumer_is_counted_until_it_reads():
    eng = engine([101], page_size=4, stream_max_events=2, max_batch_size=4)
    slow = eng.add_request([5] * 3, pd.SamplingParams(max_tokens=10), acked=True)   # not read yet
    other = eng.add_request([6] * 3, pd.SamplingParams(max_tokens=10))
    for _ in range(20):
        eng.step()
    s = eng.snapshot()
    assert eng.result(other).state == S.FINISHED
    assert (s.paused, s.running, s.waiting) == (1, 1, 0)      # it keeps its slot, held back
    while eng.has_unfinished():                               # the consumer comes back
        eng.read_events(slow)
        eng.step()
    assert eng.snapshot().paused == 0 and eng.result(slow).state == S.FINISHED


def test_prefix_cache_hits_on_a_repeated_prompt():
    eng = engine([101], page_size=4)
    prompt = [3 + i for i in range(9)]           # 2 full pages can be matched (the last token is computed)
    first = eng.generate([prompt], pd.SamplingParams(max_tokens=2, ignore_eos=True))[0]
    s = eng.snapshot()
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (9, 0)
    assert s.pages_used == 0 and s.pages_cached == 2             # 10 tokens written: 2 full pages kept
    again = eng.generate([prompt], pd.SamplingParams(max_tokens=2, ignore_eos=True))[0]
    s = eng.snapshot()
    assert (first.usage.cached_tokens, again.usage.cached_tokens) == (0, 8)
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (18, 8)


def test_snapshots_taken_while_the_engine_steps_are_consistent():
    eng = engine([101], page_size=4, max_cache_tokens=64, max_batch_size=3, trace="off")
    params = pd.SamplingParams(max_tokens=12, ignore_eos=True)
    for i in range(12):
        eng.add_request([5 + i] * (3 + i), params)
    seen, done = [], threading.Event()

    def watch():                        # a snapshot every millisecond: a tight loop starved the engine of the GIL
        while not done.is_set():
            seen.append(eng.snapshot())
            time.sleep(0.001)
    t = threading.Thread(target=watch)
    t.start()
    try:
        run(eng)
    finally:
        done.set()
        t.join()
    assert len(seen) > 1
    for s in seen:
        assert s.slots_used == s.running <= 3 and s.running + s.waiting <= 12
        assert s.pages_used <= s.pages_total and s.prefix_cache_hits <= s.prefix_cache_queries
    for a, b in zip(seen, seen[1:]):            # counters never go back
        assert b.steps >= a.steps and b.generated_tokens >= a.generated_tokens and b.preemptions >= a.preemptions
    assert seen[-1].generated_tokens <= 12 * 12 == eng.snapshot().generated_tokens
