"""Lifecycle table, page pool, slots, scheduler (chunked prefill, admission, preemption)."""
import itertools

import pytest
from hypothesis import given, settings, strategies as st

import pagedecode as pd
from pagedecode.runtime.lifecycle import ALLOWED, check_transition
from pagedecode.runtime.page_pool import PagePool
from pagedecode.runtime.slots import SlotTable

from .helpers import engine, run

S = pd.RequestState
TABLE = {
    (S.CREATED, S.QUEUED), (S.QUEUED, S.PREFILLING), (S.PREFILLING, S.DECODING), (S.DECODING, S.DRAINING),
    (S.DRAINING, S.FINISHED), (S.PREFILLING, S.DRAINING),
    (S.CREATED, S.FAILED), (S.QUEUED, S.FAILED), (S.PREFILLING, S.FAILED), (S.DECODING, S.FAILED),
    (S.DRAINING, S.FAILED),
    (S.QUEUED, S.CANCEL_REQUESTED), (S.PREFILLING, S.CANCEL_REQUESTED), (S.DECODING, S.CANCEL_REQUESTED),
    (S.CANCEL_REQUESTED, S.CANCELLED),
}


def test_transition_table_is_exactly_the_contract():
    for a, b in itertools.product(S, S):
        if (a, b) in TABLE:
            check_transition(a, b)
        else:
            with pytest.raises(pd.IllegalTransitionError):
                check_transition(a, b)
    assert {(a, b) for a, bs in ALLOWED.items() for b in bs} == TABLE
    assert {s for s in S if s.terminal} == {S.FINISHED, S.CANCELLED, S.FAILED}


def test_page_pool_double_release_raises():
    pool = PagePool(4)
    pages = pool.allocate(3)
    assert pool.allocate(2) is None and pool.free_pages == 1     # nothing taken on failure
    pool.release(pages[:2])
    with pytest.raises(pd.DoubleReleaseError):
        pool.release(pages[:1])
    pool.retain(pages[2])
    pool.release([pages[2]])
    assert pool.ref_counts[pages[2]] == 1
    pool.release([pages[2]])
    pool.check_integrity()
    assert pool.free_pages == 4


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5)), max_size=40))
def test_page_pool_integrity_under_random_use(ops):
    pool = PagePool(12)
    held = []
    for alloc, n in ops:
        if alloc:
            got = pool.allocate(n)
            if got is not None:
                held.append(got)
        elif held:
            pool.release(held.pop(n % len(held)))
        pool.check_integrity()
        assert pool.free_pages + sum(map(len, held)) == 12


def test_page_pool_confirms_the_chain_and_forgets_orphans():
    """A hashed page is found only after its own parent; when a parent loses its hash (evicted,
    its page reused), its descendants lose theirs: a reused page number never vouches for them."""
    pool = PagePool(4)
    a0, a1, a2 = pool.allocate(3)
    assert pool.register(a0, b"k0", [1], None) and pool.register(a1, b"k1", [2], a0)
    assert pool.register(a2, b"k2", [3], a1)
    assert not pool.register(pool.allocate(1)[0], b"k9", [4], 3)        # an unhashed parent: refused
    assert pool.lookup(b"k1", [2], a0) == a1
    assert pool.lookup(b"k1", [2], None) is None                       # same key and tokens, other place
    assert pool.lookup(b"k1", [2], a2) is None                         # ... or other parent
    pool.release([a2, a1, a0, 3])
    pool.check_integrity()
    (reused,) = pool.allocate(1)           # the free page 3 first ...
    (reused,) = pool.allocate(1)           # ... then the least recently used cached page: a2, a leaf
    assert reused == a2 and pool.cached_pages == 2
    pool.release([reused, 3])
    pool.clear_cache()
    assert pool.cached_pages == 0 and pool.free_pages == 4
    pool.check_integrity()
    b0, b1 = pool.allocate(2)
    assert pool.register(b0, b"k0", [1], None) and pool.register(b1, b"k1", [2], b0)
    pool.release([b1, b0])
    pool.allocate(2)                       # the two free pages
    (head,) = pool.allocate(1)             # the LRU cached page: b1 then b0 were released, b1 is older
    assert head == b1 and pool.cached_pages == 1
    (head,) = pool.allocate(1)
    assert head == b0 and pool.cached_pages == 0
    pool.check_integrity()


def test_page_pool_evicting_a_parent_drops_its_children():
    pool = PagePool(3)
    p0, p1 = pool.allocate(2)
    pool.register(p0, b"k0", [1], None)
    pool.register(p1, b"k1", [2], p0)
    pool.release([p0, p1])                 # head first: the head is evicted first
    pool.allocate(1)                       # the free page
    (taken,) = pool.allocate(1)
    assert taken == p0
    assert pool.cached_pages == 0 and pool.lookup(b"k1", [2], p0) is None   # its child went with it
    assert pool.free_pages == 1                                             # ... and is free again
    pool.check_integrity()
    assert pool.register(taken, b"k5", [9], None)                           # the page number reused
    assert pool.lookup(b"k1", [2], taken) is None
    pool.check_integrity()


def test_slots_release_once():
    slots = SlotTable(2)
    a, b = slots.acquire(), slots.acquire()
    assert slots.free_slots == 0 and {a, b} == {0, 1}
    with pytest.raises(RuntimeError, match="no free batch slot"):   # never an Optional read as slot 0
        slots.acquire()
    slots.release(a)
    with pytest.raises(pd.DoubleReleaseError):
        slots.release(a)
    assert slots.acquire() == a and b is not None


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
