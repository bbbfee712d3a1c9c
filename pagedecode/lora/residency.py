"""Which adapters hold the max_loras slots of the stacks: a slot is held while any request of
its adapter runs (has a batch slot), and an adapter nobody runs stays resident until a new one
needs its slot, least recently used first.

    acquire(adapter)   its slot (loaded into a free or evicted slot on first use), one more user
    release(slot)      one user fewer; at zero the adapter joins the idle list (LRU order)
    can_acquire        whether acquire would find a slot now (the scheduler asks before admitting)
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from ..errors import DoubleReleaseError
from .adapter import LoRAAdapter
from .stacks import LoRAStacks


class AdapterResidency:
    def __init__(self, max_loras: int, stacks: Callable[[], LoRAStacks]) -> None:
        self.max_loras = max_loras
        self._stacks = stacks                       # made on first use (no memory for a base-only engine)
        self.slot_of: dict[tuple[str, str], int] = {}    # resident adapters by key
        self.key_of: dict[int, tuple[str, str]] = {}
        self.users = [0] * max_loras
        self.idle: OrderedDict[int, None] = OrderedDict()    # resident slots with no user, oldest first
        self.loads = 0                                  # adapters written into a slot (first use or reload)

    def _free_slot(self) -> int | None:
        return next((s for s in range(self.max_loras) if s not in self.key_of), None)

    def can_acquire(self, adapter: LoRAAdapter) -> bool:
        return adapter.key in self.slot_of or self._free_slot() is not None or bool(self.idle)

    def acquire(self, adapter: LoRAAdapter) -> int:
        slot = self.slot_of.get(adapter.key)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                if not self.idle:
                    raise RuntimeError(f"no LoRA slot for adapter {adapter.name!r}: all {self.max_loras} run "
                                       "(ask can_acquire first)")
                slot, _ = self.idle.popitem(last=False)           # the least recently used
                del self.slot_of[self.key_of.pop(slot)]
            self._stacks().write(slot, adapter)
            self.slot_of[adapter.key], self.key_of[slot] = slot, adapter.key
            self.loads += 1
        self.idle.pop(slot, None)
        self.users[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        if self.users[slot] <= 0:
            raise DoubleReleaseError(f"LoRA slot {slot} released with no user")
        self.users[slot] -= 1
        if self.users[slot] == 0:
            self.idle[slot] = None                     # most recently used last

    def forget(self, key: tuple[str, str]) -> None:
        """An unloaded adapter: its slot is freed now if nobody runs it (else when they end, as idle)."""
        slot = self.slot_of.get(key)
        if slot is not None and self.users[slot] == 0:
            del self.slot_of[key], self.key_of[slot]
            self.idle.pop(slot, None)
            self._stacks().clear(slot)

    def resident(self) -> list[str]:
        return [self.key_of[s][0] for s in sorted(self.key_of)]
