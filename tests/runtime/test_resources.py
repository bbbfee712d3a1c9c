"""Lifecycle table and batch slots. The page pool is tested in test_page_pool.py, the scheduler in
test_scheduler.py."""
import itertools

import pytest

import pagedecode as pd
from pagedecode.runtime.lifecycle import ALLOWED, check_transition
from pagedecode.runtime.slots import SlotTable

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
