"""The small pieces alone: stop matchers, the batch builder (odd sizes on purpose). The scheduler's
units are in test_scheduler.py, the page pool's in test_page_pool.py."""
import pytest
import torch

import pagedecode as pd
from pagedecode.runtime.batching import build_batch
from pagedecode.runtime.output.stop import StopIdMatcher, find_stop_string, stop_prefix_len

from .helpers import commit, req, scheduler

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
    want = [dec.seq.pages[5 // 4] * 4 + 5 % 4] + [pre.seq.pages[p // 4] * 4 + p % 4 for p in range(7)]
    assert b.slot_mapping.tolist() == want
    assert b.logits_indices.tolist() == [0, 7] and b.logits_seqs == [0, 1]
    assert b.page_table.tolist() == [dec.seq.pages, pre.seq.pages]


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
