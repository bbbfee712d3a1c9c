"""Batch slots: a free list and three verbs. A slot bounds how many requests run at once."""
from __future__ import annotations

from ..errors import DoubleReleaseError


class SlotTable:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"need at least one batch slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._held: set[int] = set()

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        """A free slot; callers check free_slots first (none free is a scheduler bug)."""
        if not self._free:
            raise RuntimeError("no free batch slot")
        slot = self._free.pop()
        self._held.add(slot)
        return slot

    def release(self, slot: int) -> None:
        if slot not in self._held:
            raise DoubleReleaseError(f"batch slot {slot} released twice")
        self._held.remove(slot)
        self._free.append(slot)
