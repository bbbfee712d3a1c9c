"""Deadlines, model errors, backpressure, replay, usage and trace export."""
import json
import time

import pytest

import pagedecode as pd

from .helpers import check_stream, engine, of, run

S, R = pd.RequestState, pd.FinishReason


def test_deadline_while_queued_fails_without_draining():
    eng = engine([101], max_batch_size=1, on_forward=lambda info: time.sleep(0.01))
    eng.add_request([5], pd.SamplingParams(max_tokens=20))
    late = eng.add_request([6], pd.SamplingParams(max_tokens=2, deadline_s=0.03))
    events = run(eng)
    out = eng.result(late)
    assert out.state == S.FAILED and out.finish_reason == R.DEADLINE_EXCEEDED
    assert out.selected_token_ids == [] and "deadline" in out.error
    states = [r["new"] for r in eng.trace(late) if r["kind"] == "state"]
    assert states == ["queued", "failed"]
    check_stream(events, late)


def test_deadline_while_decoding_drains_to_finished():
    eng = engine([101, 102], on_forward=lambda info: time.sleep(0.01), stream_max_events=10_000)
    rid = eng.add_request([5], pd.SamplingParams(max_tokens=10_000, deadline_s=0.1, stop=["ABX"]))
    events = run(eng)
    out = eng.result(rid)
    assert out.state == S.FINISHED and out.finish_reason == R.DEADLINE_EXCEEDED
    assert 1 <= len(out.selected_token_ids) < 100
    assert out.text == "".join(d.text for d in of(events, rid, pd.DeltaEvent))
    states = [r["new"] for r in eng.trace(rid) if r["kind"] == "state"]
    assert states[-2:] == ["draining", "finished"]


def test_model_error_fails_that_step_and_the_engine_goes_on():
    calls = {"n": 0}

    def on_forward(info):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device fault")

    eng = engine([101], on_forward=on_forward)
    a = eng.add_request([5], pd.SamplingParams(max_tokens=10))
    b = eng.add_request([6], pd.SamplingParams(max_tokens=10))
    events = run(eng)
    for rid in (a, b):
        out = eng.result(rid)
        assert out.state == S.FAILED and out.finish_reason == R.MODEL_ERROR and "device fault" in out.error
        assert out.text == "ABAB"
        check_stream(events, rid)
        assert [r["resource"] for r in eng.trace(rid) if r["kind"] == "release"].count("pages") == 1
    assert eng.pool.free_pages == eng.pool.num_pages
    c = eng.add_request([5], pd.SamplingParams(max_tokens=2))
    run(eng)
    assert eng.result(c).text == "ABAB"


def test_cancel_while_queued_allocates_nothing():
    eng = engine([101], max_batch_size=1)
    eng.add_request([5], pd.SamplingParams(max_tokens=5))
    q = eng.add_request([5] * 30, pd.SamplingParams(max_tokens=5))
    eng.step()
    assert eng.cancel(q) is True and eng.cancel(q) is True     # still pending: idempotent
    run(eng)
    out = eng.result(q)
    assert out.state == S.CANCELLED and out.usage.processed_tokens == 0
    assert not any(r["kind"] == "prefill.chunk" for r in eng.trace(q))


def test_backpressure_pauses_only_the_slow_request_and_resumes_exactly(stories_engine_factory):
    params = pd.SamplingParams(max_tokens=24, temperature=1.0, seed=11)
    eng = stories_engine_factory(stream_max_events=3)
    want = eng.generate("Once upon a time", params)[0]
    slow = eng.add_request("Once upon a time", params, acked=True)
    fast = eng.add_request("The cat", pd.SamplingParams(max_tokens=24))
    for _ in range(10):
        eng.step()
    assert len(eng.result(fast).selected_token_ids) == 10         # the other keeps its pace
    stalled = len(eng.result(slow).selected_token_ids)
    assert stalled <= 3
    assert any(r["kind"] == "backpressure.paused" for r in eng.trace(slow))
    got = []
    while eng.has_unfinished():
        got += eng.read_events(slow, 2)
        eng.step()
        assert eng.newest_event(slow)[0] - got[-1].seq <= 3 + 2     # bounded (one step's overshoot)
    got += eng.read_events(slow)
    out = eng.result(slow)
    assert out.token_ids == want.token_ids and out.text == want.text
    assert "".join(e.text for e in got if isinstance(e, pd.DeltaEvent)) == want.text
    assert [e.seq for e in got] == list(range(len(got)))
    assert isinstance(got[-1], pd.TerminalEvent)


def test_backpressure_fail_policy_ends_with_its_own_reason():
    eng = engine([101], stream_max_events=2, backpressure="fail", backpressure_timeout_s=0.02)
    rid = eng.add_request([5], pd.SamplingParams(max_tokens=1000), acked=True)
    t0 = time.perf_counter()
    while eng.has_unfinished() and time.perf_counter() - t0 < 5:
        eng.step()
        time.sleep(0.005)
    out = eng.result(rid)
    assert out.state == S.FAILED and out.finish_reason == R.TRANSPORT_ERROR
    events = eng.read_events(rid)
    assert "".join(e.text for e in events if isinstance(e, pd.DeltaEvent)) == out.text   # nothing dropped


def test_replay_and_dedupe():
    eng = engine([101, 102, 103])
    rid = eng.add_request([5], pd.SamplingParams(max_tokens=3))
    events = run(eng)
    mine = of(events, rid)
    assert eng.replay(rid) == mine
    partial = mine[:2]
    resumed = eng.replay(rid, after_seq=partial[-1].seq)
    seen, merged = set(), []
    for e in partial + eng.replay(rid, after_seq=0) + resumed:      # overlap on purpose
        if (e.request_id, e.seq) not in seen:
            seen.add((e.request_id, e.seq))
            merged.append(e)
    assert sorted(merged, key=lambda e: e.seq) == mine


def test_usage_and_timings():
    eng = engine([101, 102, EOS := 2])
    rid = eng.add_request([5, 6], pd.SamplingParams(max_tokens=10, stop="DZ"))
    run(eng)
    out = eng.result(rid)
    u = out.usage
    assert (u.prompt_tokens, u.selected_tokens, u.processed_tokens, u.returned_tokens, u.returned_bytes) == \
        (2, 3, 4, 2, 4)
    assert out.finish_reason == R.EOS and out.text == "ABCD" and EOS not in out.token_ids
    t = out.timings
    assert 0 < t.queue_s < 5 and t.prefill_s > 0 and t.decode_s > 0 and t.hold_s > 0


def test_logprobs_reported_with_their_tokens():
    eng = engine([101, 102])
    rid = eng.add_request([5], pd.SamplingParams(max_tokens=2, logprobs=0))
    events = run(eng)
    deltas = of(events, rid, pd.DeltaEvent)
    assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)
    assert all(-1e-3 < lp <= 0 for d in deltas for lp in d.logprobs)
    assert eng.result(rid).logprobs is not None and len(eng.result(rid).logprobs) == 2


def test_trace_exports(tmp_path):
    eng = engine([101, 102])
    rid = eng.add_request([5], pd.SamplingParams(max_tokens=2))
    run(eng)
    lines = [json.loads(x) for x in pd.to_jsonl(eng.trace(rid)).splitlines()]
    assert lines[0]["kind"] == "added" and lines[-1]["kind"] == "release"
    chrome = pd.to_chrome({rid: eng.trace(rid)}, eng.step_records)
    text = json.dumps(chrome)
    evs = json.loads(text)["traceEvents"]
    assert {e["ph"] for e in evs} >= {"b", "e", "n", "X", "M"}
    assert sum(e["ph"] == "X" for e in evs) == len(eng.step_records) == 2    # prefill+1st, decode+2nd
    begin = [e for e in evs if e["ph"] == "b"][0]
    assert begin["id"] == rid and all(e["ts"] >= begin["ts"] for e in evs if e.get("id") == rid)


def test_shutdown_ends_every_live_request_once():
    eng = engine([101])
    ids = [eng.add_request([5], pd.SamplingParams(max_tokens=100)) for _ in range(3)]
    eng.step()
    events = eng.shutdown()
    assert not eng.has_unfinished()
    for rid in ids:
        assert len(of(events, rid, pd.TerminalEvent)) == 1
        assert eng.result(rid).state == S.CANCELLED
    assert eng.pool.free_pages == eng.pool.num_pages


def test_finished_results_are_kept_up_to_a_bound():
    eng = engine([101], max_finished_kept=3)
    ids = [eng.add_request([5], pd.SamplingParams(max_tokens=1)) for _ in range(5)]
    run(eng)
    for rid in ids[:2]:
        with pytest.raises(KeyError):
            eng.result(rid)
    assert [eng.result(rid).text for rid in ids[2:]] == ["AB"] * 3


def test_a_pinned_result_is_kept_past_the_bound_until_unpinned():
    eng = engine([101], max_finished_kept=2, max_finished_bytes=1)
    first = eng.add_request([5], pd.SamplingParams(max_tokens=1), pinned=True)
    later = eng.add_request([5], pd.SamplingParams(max_tokens=1))
    eng.pin(later)                                # two pins on one (live) request
    eng.pin(later)
    run(eng)
    rest = [eng.add_request([5], pd.SamplingParams(max_tokens=1)) for _ in range(4)]
    run(eng)
    assert eng.result(first).text == eng.result(later).text == "AB"      # pinned: passed over
    with pytest.raises(pd.ForgottenRequestError):
        eng.result(rest[0])
    eng.unpin(first)                              # the last pin: eviction takes it now
    with pytest.raises(pd.ForgottenRequestError):
        eng.result(first)
    eng.unpin(later)
    assert eng.result(later).text == "AB"         # one pin left
    eng.unpin(later)
    assert eng.requests.num_finished == 1         # the byte budget always keeps one: this one


def test_a_cleanup_failure_is_logged_and_the_stream_stays_closed(caplog):
    eng = engine([101])
    rid = eng.add_request([5], pd.SamplingParams(max_tokens=2))
    real_release = eng.pool.release

    def broken(pages):
        raise RuntimeError("allocator on fire")
    eng.pool.release = broken
    with caplog.at_level("ERROR", logger="pagedecode"):
        events = run(eng)
    eng.pool.release = real_release
    out = eng.result(rid)
    assert out.state == S.FINISHED and out.text == "ABAB"
    assert len(of(events, rid, pd.TerminalEvent)) == 1 and isinstance(of(events, rid)[-1], pd.TerminalEvent)
    assert "releasing the pages and slot of request" in caplog.text and "allocator on fire" in caplog.text
    releases = [r["resource"] for r in eng.trace(rid) if r["kind"] == "release"]
    assert sorted(releases) == sorted(["pages", "slot", "rng", "stream", "trace", "grammar"])   # the rest still released
    assert eng.slots.free_slots == eng.slots.num_slots


def test_top_logprobs_are_the_n_most_likely_with_the_chosen_one(stories_engine_factory):
    eng = stories_engine_factory()
    out = eng.generate("Once upon a time", pd.SamplingParams(max_tokens=6, logprobs=5))[0]
    assert len(out.top_logprobs) == len(out.token_ids) == 6
    for tok, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
        assert len(top) == 5 and [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert top[0][0] == tok and abs(top[0][1] - lp) < 1e-5          # greedy: the best one
    none = eng.generate("Once upon a time", pd.SamplingParams(max_tokens=3, logprobs=0))[0]
    assert none.top_logprobs is None and len(none.logprobs) == 3
    deltas = [e for e in eng.replay(out.request_id) if isinstance(e, pd.DeltaEvent)]   # from the compact form
    assert [t for d in deltas for t in d.top_logprobs] == out.top_logprobs
