"""The scheduler: admission order, the chunked-prefill token budget, decode first, preemption's
choice of victim, paused requests skipped; alone (a bare Scheduler) and inside an engine."""
import pytest

import pagedecode as pd

from .helpers import commit, engine, req, run, scheduler

S, R = pd.RequestState, pd.FinishReason

# -- a bare scheduler ----------------------------------------------------------------------------


def test_chunked_prefill_under_the_budget_and_decode_first():
    sch = scheduler(budget=7)
    a, b = req("a", 3), req("b", 13)
    sch.add(a)
    sch.add(b)
    p1 = sch.schedule(lambda r: True)
    assert [(s.request.request_id, s.num_new, s.samples) for s in p1.prefill] == [("a", 3, True), ("b", 4, False)]
    commit(p1)
    p2 = sch.schedule(lambda r: True)
    assert [(s.request.request_id, s.num_new) for s in p2.decode] == [("a", 1)]
    assert [(s.request.request_id, s.num_new) for s in p2.prefill] == [("b", 6)]     # 7 - 1 decode
    assert len(b.seq.pages) == sch.pages_for(10) and len(a.seq.pages) == 1


def test_admission_skips_a_paused_request_and_keeps_order():
    sch = scheduler()
    paused, x, y = req("paused", 2), req("x", 2), req("y", 2)
    for r in (paused, x, y):
        sch.add(r)
    plan = sch.schedule(lambda r: r is not paused)
    assert [s.request.request_id for s in plan.prefill] == ["x", "y"]
    assert list(sch.waiting) == [paused]


def test_preemption_takes_the_newest_and_paused_first():
    sch = scheduler(pages=3, page=4, slots=3, budget=64)
    old, mid, new = req("old", 4), req("mid", 4), req("new", 4)
    for r in (old, mid, new):
        sch.add(r)
    commit(sch.schedule(lambda r: True))                   # each holds one full page
    assert sch.pool.free_pages == 0
    plan = sch.schedule(lambda r: True)                    # everyone needs a second page
    assert [r.request_id for r in plan.preempted] == ["new", "mid"]
    assert [s.request.request_id for s in plan.decode] == ["old"] and mid.seq.num_computed == 0
    assert list(sch.waiting) == [mid, new] and mid.seq.slot is None and not mid.seq.pages
    sch2 = scheduler(pages=3, page=4, slots=3, budget=64)
    a, b, c = req("a", 4), req("b", 4), req("c", 4)
    for r in (a, b, c):
        sch2.add(r)
    commit(sch2.schedule(lambda r: True))
    plan = sch2.schedule(lambda r: r is not a)             # a's consumer stopped reading
    assert plan.preempted[0] is a                          # the paused one goes first, though oldest


def test_release_gives_back_pages_and_slot_once():
    sch = scheduler()
    r = req("r", 9)
    sch.add(r)
    sch.schedule(lambda q: True)
    assert r.seq.pages and r.seq.slot is not None
    sch.release(r)
    assert not r.seq.pages and r.seq.slot is None and r not in sch.running
    assert sch.pool.free_pages == 11 and sch.slots.free_slots == 3
    sch.release(r)                                         # nothing left to give back: no double release
    assert sch.pool.free_pages == 11 and sch.slots.free_slots == 3
    sch.pool.check_integrity()


def test_a_write_into_a_shared_or_cached_page_is_caught():
    sch = scheduler(pages=6, page=4, slots=2, budget=64)
    r = req("r", 6)
    sch.add(r)
    commit(sch.schedule(lambda q: True))
    sch.check_integrity()
    sch.pool.register(r.seq.pages[1], b"key", [5, 5, 5, 5], None)    # its page being written is now "cached"
    sch.schedule(lambda q: True)
    with pytest.raises(AssertionError, match="writes page"):
        sch.check_integrity()


def test_admission_is_first_come_and_the_head_waits_for_pages():
    sch = scheduler(pages=2, page=4, slots=3, budget=64)
    big, small = req("big", 12), req("small", 2)            # big needs 3 pages of 2
    sch.add(big)
    sch.add(small)
    plan = sch.schedule(lambda r: True)
    assert plan.empty and not plan.preempted                 # small does not overtake the head
    assert list(sch.waiting) == [big, small] and sch.pool.free_pages == 2 and big.seq.slot is None


def test_admission_stops_at_the_free_slots_and_the_budget():
    sch = scheduler(pages=20, page=4, slots=2, budget=64)
    rs = [req(n, 3) for n in "abc"]
    for r in rs:
        sch.add(r)
    plan = sch.schedule(lambda r: True)
    assert [r.request_id for r in plan.admitted] == ["a", "b"] and list(sch.waiting) == [rs[2]]
    sch2 = scheduler(pages=20, page=4, slots=3, budget=5)
    rs = [req(n, 3) for n in "abc"]
    for r in rs:
        sch2.add(r)
    plan = sch2.schedule(lambda r: True)
    assert [(s.request.request_id, s.num_new, s.samples) for s in plan.prefill] == [("a", 3, True), ("b", 2, False)]
    assert list(sch2.waiting) == [rs[2]]                    # the budget ran out before c


def test_decode_goes_first_when_the_budget_is_tight():
    sch = scheduler(pages=20, page=4, slots=3, budget=1)
    a, b = req("a", 1), req("b", 1)
    sch.add(a)
    commit(sch.schedule(lambda r: True))                     # a: prompt done, decoding
    sch.add(b)
    plan = sch.schedule(lambda r: True)
    assert [s.request.request_id for s in plan.decode] == ["a"] and not plan.prefill
    assert list(sch.waiting) == [b]


def test_a_paused_running_request_is_not_scheduled_and_keeps_its_pages():
    sch = scheduler(pages=20, page=4, slots=3, budget=64)
    a, b = req("a", 3), req("b", 3)
    sch.add(a)
    sch.add(b)
    commit(sch.schedule(lambda r: True))
    plan = sch.schedule(lambda r: r is not a)
    assert [s.request.request_id for s in plan.decode] == ["b"] and not plan.preempted
    assert a.seq.pages and a.seq.slot is not None and a in sch.running           # paused, not preempted


def test_a_preempted_request_is_readmitted_first_and_recomputes():
    sch = scheduler(pages=3, page=4, slots=3, budget=64)
    old, mid, new = req("old", 4), req("mid", 4), req("new", 4)
    for r in (old, mid, new):
        sch.add(r)
    commit(sch.schedule(lambda r: True))
    sch.schedule(lambda r: True)                             # mid and new preempted for old
    assert sch.preemptions == 2
    sch.release(old)                                         # old ends: its two pages are free
    plan = sch.schedule(lambda r: True)
    assert [r.request_id for r in plan.admitted] == ["mid"]  # front of the queue, in order
    assert [(s.num_new, s.samples) for s in plan.prefill] == [(5, True)]    # 4 prompt + 1 output, again
    sch.check_integrity()


def test_a_request_that_outgrows_the_pool_preempts_itself():
    sch = scheduler(pages=2, page=4, slots=2, budget=64)
    a, b = req("a", 4), req("b", 4)
    sch.add(a)
    sch.add(b)
    commit(sch.schedule(lambda r: True))                     # one page each, the pool empty
    plan = sch.schedule(lambda r: r is not b)                # b paused: the paused one goes first
    assert plan.preempted == [b] and [s.request for s in plan.decode] == [a] and len(a.seq.pages) == 2
    commit(plan)
    sch.release(b)
    solo = scheduler(pages=1, page=4, slots=1, budget=64)
    c = req("c", 4)
    solo.add(c)
    commit(solo.schedule(lambda r: True))
    plan = solo.schedule(lambda r: True)                     # c needs a second page: only its own
    assert plan.preempted == [c] and plan.empty and list(solo.waiting) == [c] and not c.seq.pages
    solo.check_integrity()


# -- inside an engine ----------------------------------------------------------------------------


def test_chunked_prefill_keeps_running_requests_decoding():
    eng = engine([101], max_tokens_per_step=8, page_size=4)
    first = eng.add_request([5] * 3, pd.SamplingParams(max_tokens=30))
    eng.step()                                              # first is now decoding
    long_ = eng.add_request([5] * 40, pd.SamplingParams(max_tokens=2))
    decoded = []
    while eng.result(long_).state != S.DECODING and eng.has_unfinished():
        before = len(eng.result(first).selected_token_ids)
        eng.step()
        decoded.append(len(eng.result(first).selected_token_ids) - before)
        eng.pool.check_integrity()
    assert len(decoded) >= 40 // 7 and all(d == 1 for d in decoded)   # one token every step
    chunks = [r["tokens"] for r in eng.trace(long_) if r["kind"] == "prefill.chunk"]
    assert sum(chunks) == 40 and max(chunks) <= 7
    run(eng)


def test_admission_waits_for_pages_and_slots():
    eng = engine([101], max_batch_size=2, max_cache_tokens=64, page_size=16)
    ids = [eng.add_request([5] * 20, pd.SamplingParams(max_tokens=3)) for _ in range(4)]
    eng.step()
    assert eng.slots.free_slots == 0
    assert sum(eng.result(i).state == S.QUEUED for i in ids) == 2
    run(eng)
    assert all(eng.result(i).text == "ABABAB" for i in ids)
    assert eng.pool.free_pages == eng.pool.num_pages


def test_a_paused_consumer_does_not_block_admission_and_is_preempted_first():
    eng = engine([101], page_size=4, max_cache_tokens=16, stream_max_events=2, max_batch_size=4)
    slow = eng.add_request([5] * 3, pd.SamplingParams(max_tokens=10), acked=True)   # never read
    for _ in range(6):
        eng.step()
    assert eng.requests.get(slow).delivery.paused_since is not None
    others = [eng.add_request([6] * 6, pd.SamplingParams(max_tokens=6)) for _ in range(2)]
    for _ in range(200):
        if all(eng.result(r).state.terminal for r in others):
            break
        eng.step()
        eng.pool.check_integrity()
    assert [eng.result(r).state for r in others] == [S.FINISHED] * 2
    assert any(r["kind"] == "preempted" for r in eng.trace(slow))      # it gave its pages up first
    before = eng.result(slow).selected_token_ids
    while eng.has_unfinished():                            # the consumer comes back
        eng.read_events(slow)
        eng.step()
    out = eng.result(slow)
    assert out.state == S.FINISHED and out.selected_token_ids[:len(before)] == before
    assert out.text == "AB" * 10 and out.finish_reason == R.MAX_OUTPUT_TOKENS


def test_preemption_recomputes_with_step_state_unchanged(stories_engine_factory):
    prompts = ["Once upon a time", "Lily and Tom", "The cat", "Tom had a big red ball"]
    params = pd.SamplingParams(max_tokens=40)
    sampled = [pd.SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=7 + i, repetition_penalty=1.3,
                                 presence_penalty=0.4, frequency_penalty=0.2, logit_bias={426: -2.0})
               for i in range(4)]
    calm = stories_engine_factory()
    want = [o.token_ids for o in calm.generate(prompts, params)]
    want_sampled = [o.token_ids for o in calm.generate(prompts, sampled)]
    tight = stories_engine_factory(max_cache_tokens=64, page_size=8)      # 8 pages for 4 x 45 tokens
    for ps, expect in ((params, want), (sampled, want_sampled)):
        rids = [tight.add_request(p, s) for p, s in zip(prompts, ps if isinstance(ps, list) else [ps] * 4)]
        while tight.has_unfinished():
            tight.step()
            tight.pool.check_integrity()
        outs = [tight.result(r) for r in rids]
        assert [o.token_ids for o in outs] == expect
        preempted = sum(r["kind"] == "preempted" for rid in rids for r in tight.trace(rid))
        assert preempted > 0
        assert sum(o.usage.processed_tokens for o in outs) > sum(
            o.usage.prompt_tokens + o.usage.selected_tokens - 1 for o in outs)   # recompute counted
        assert tight.pool.free_pages == tight.pool.num_pages
