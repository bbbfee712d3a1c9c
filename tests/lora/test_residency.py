"""The adapters' slots (lora/residency.py) and the batch's segments (lora/stacks.py), alone."""
from pathlib import Path

import pytest
import torch

from pagedecode.errors import DoubleReleaseError
from pagedecode.lora.adapter import LoRAAdapter, LoRAWeights
from pagedecode.lora.residency import AdapterResidency
from pagedecode.lora.stacks import segments


class FakeStacks:
    def __init__(self):
        self.writes: list[tuple[int, str]] = []

    def write(self, slot, adapter):
        self.writes.append((slot, adapter.name))

    def clear(self, slot):
        self.writes.append((slot, ""))


def adapter(name, digest="d"):
    w = LoRAWeights(torch.zeros(1, 2), torch.zeros(2, 1), 1.0)
    return LoRAAdapter(name, Path("/x") / name, digest, 1, {(0, "q_proj"): w})


def residency(n):
    stacks = FakeStacks()
    return AdapterResidency(n, lambda: stacks), stacks   # type: ignore[arg-type, return-value]


def test_loaded_on_first_use_and_shared_while_running():
    r, stacks = residency(2)
    a = adapter("a")
    assert r.acquire(a) == r.acquire(a) == 0 and stacks.writes == [(0, "a")] and r.users[0] == 2
    r.release(0)
    r.release(0)
    with pytest.raises(DoubleReleaseError):
        r.release(0)


def test_least_recently_used_idle_adapter_is_evicted_never_a_running_one():
    r, stacks = residency(2)
    a, b, c, d = (adapter(n) for n in "abcd")
    sa, sb = r.acquire(a), r.acquire(b)
    assert not r.can_acquire(c)                         # both run
    r.release(sb)
    r.release(sa)                                       # a released last: b is the least recently used
    assert r.can_acquire(c) and r.acquire(c) == sb and r.resident() == ["a", "c"]
    assert r.acquire(a) == sa and stacks.writes[-1] == (sb, "c")       # a still resident: no reload
    assert not r.can_acquire(d)                         # a and c run
    r.release(sa)
    assert r.acquire(d) == sa and r.resident() == ["d", "c"] and r.loads == 4


def test_a_reloaded_name_with_other_weights_is_another_adapter():
    r, _ = residency(2)
    old, new = adapter("a", "1"), adapter("a", "2")
    assert r.acquire(old) != r.acquire(new)
    r.forget(old.key)                                   # in use: kept until released
    assert "a" in r.resident()


@pytest.mark.parametrize("slots,rows,starts,seg_slots", [
    ([-1, -1], [1, 1], [0, 2], [-1]),
    ([0, 0, 1, -1, 1], [1, 1, 5, 3, 2], [0, 2, 7, 10, 12], [0, 1, -1, 1]),
    ([2], [7], [0, 7], [2]),
])
def test_segments_are_runs_of_one_slot(slots, rows, starts, seg_slots):
    assert segments(slots, rows) == (starts, seg_slots)
