"""The small pieces alone: stop matchers, the scheduler, the batch builder (odd sizes on purpose)."""
import random

import pytest
import torch

import pagedecode as pd
from pagedecode.runtime.batching import build_batch
from pagedecode.runtime.intake import make_request
from pagedecode.runtime.lifecycle import RequestState
from pagedecode.runtime.page_pool import PagePool
from pagedecode.runtime.scheduler import Scheduler
from pagedecode.runtime.slots import SlotTable
from pagedecode.runtime.stop import StopIdMatcher, find_stop_string, stop_prefix_len

from .helpers import tokenizer

# -- stop matchers ------------------------------------------------------------------------------


@pytest.mark.parametrize("text, stops, want", [
    ("abcdef", ["cd", "bcde"], ("cd", 2, 4)),                # earliest end wins over earliest start
    ("abcdef", ["de", "cde"], ("cde", 2, 5)),                # same end: the longest
    ("abcdef", ["ef", "ef"], ("ef", 4, 6)),                  # then list order
    ("aaaa", ["aa"], ("aa", 0, 2)),
    ("abc", ["x"], None),
    ("", ["x"], None),
])
def test_find_stop_string(text, stops, want):
    hit = find_stop_string(text, stops)
    assert (None if hit is None else (hit.stop, hit.start, hit.end)) == want


@pytest.mark.parametrize("text, stops, held", [
    ("hello wor", ["world"], 3), ("hello", ["world"], 0), ("ab", ["abc", "bcd"], 2), ("xb", ["abc", "bcd"], 1),
    ("abc", ["abc"], 0),      # a complete stop is a hit, not a held prefix
    ("é", ["éa"], 1), ("", ["a"], 0),
])
def test_stop_prefix_len_is_minimal(text, stops, held):
    assert stop_prefix_len(text, stops) == held


def test_stop_id_matcher():
    m = StopIdMatcher([[7], [3, 4, 5], [4, 5]])
    assert m.feed(3) is None and m.held == 1
    assert m.feed(4) is None and m.held == 2
    assert m.feed(5) == (3, 4, 5) and m.held == 0           # both end here: the longest
    assert m.feed(4) is None and m.held == 1
    assert m.feed(9) is None and m.held == 0
    assert m.feed(7) == (7,)
    m.feed(3)
    m.release()
    assert m.held == 0 and m.feed(4) is None and m.feed(5) == (4, 5)   # nothing carried over
    assert StopIdMatcher([]).feed(1) is None


# -- scheduler ---------------------------------------------------------------------------------

def req(rid, n_prompt, max_tokens=5):
    r = make_request([5] * n_prompt, pd.SamplingParams(max_tokens=max_tokens), rid, tokenizer=tokenizer(),
                     vocab_size=200, max_context=1000, rng=random.Random(0), trace_level="lifecycle")
    r.transition(RequestState.QUEUED)
    return r


def scheduler(pages=11, page=4, slots=3, budget=7):
    return Scheduler(PagePool(pages), SlotTable(slots), page, budget)


def commit(plan):
    """What the engine does after the step: advance, and choose a token for sampling seqs."""
    for s in plan.seqs:
        s.request.num_computed += s.num_new
        if s.samples:
            s.request.output_ids.append(101)
            if s.request.state == RequestState.PREFILLING:
                s.request.transition(RequestState.DECODING)


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
    assert len(b.pages) == sch.pages_for(10) and len(a.pages) == 1


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
    assert [s.request.request_id for s in plan.decode] == ["old"] and mid.num_computed == 0
    assert list(sch.waiting) == [mid, new] and mid.slot is None and not mid.pages
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
    assert sch.release(r) == (True, True)
    assert sch.pool.free_pages == 11 and sch.slots.free_slots == 3
    assert sch.release(r) == (False, False)                # nothing left to give back
    sch.pool.check_integrity()


# -- batch builder ------------------------------------------------------------------------------

def test_build_batch_layout_with_odd_sizes():
    sch = scheduler(pages=13, page=4, slots=5, budget=99)
    dec, pre = req("dec", 5), req("pre", 7)
    sch.add(dec)
    commit(sch.schedule(lambda r: True))                    # dec: 5 cached, one token chosen
    sch.add(pre)
    plan = sch.schedule(lambda r: True)
    b = build_batch(plan, 4, torch.device("cpu"))
    assert b.num_decode == 1 and b.num_seqs == 2 and b.num_tokens == 1 + 7
    assert b.positions.tolist() == [5] + list(range(7))
    assert b.cu_q.tolist() == [0, 1, 8] and b.seq_lens.tolist() == [6, 7]
    assert b.input_ids.tolist() == [101] + [5] * 7
    want = [dec.pages[5 // 4] * 4 + 5 % 4] + [pre.pages[p // 4] * 4 + p % 4 for p in range(7)]
    assert b.slot_mapping.tolist() == want
    assert b.logits_indices.tolist() == [0, 7] and b.logits_seqs == [0, 1]
    assert b.page_table.tolist() == [dec.pages, pre.pages]


def test_a_write_into_a_shared_or_cached_page_is_caught():
    sch = scheduler(pages=6, page=4, slots=2, budget=64)
    r = req("r", 6)
    sch.add(r)
    commit(sch.schedule(lambda q: True))
    sch.check_integrity()
    sch.pool.register(r.pages[1], b"key", [5, 5, 5, 5], None)    # its page being written is now "cached"
    sch.schedule(lambda q: True)
    with pytest.raises(AssertionError, match="writes page"):
        sch.check_integrity()


def test_freeze_heap_takes_what_lives_now_out_of_the_collector():
    import gc

    class Marker:
        pass
    kept = [Marker()]
    try:
        frozen = pd.freeze_heap()
        assert frozen > 10_000 and gc.get_freeze_count() > 10_000   # torch's heap, at least
        assert not any(o is kept for o in gc.get_objects())     # full passes no longer walk it
        later = [Marker()]
        assert any(o is later for o in gc.get_objects())        # what comes after is collected as usual
    finally:
        gc.unfreeze()
