"""Fixed-size slot allocation for a tier: pure bookkeeping, no bytes.

A tier holds `num_slots` equal-sized block slots. `allocate` hands out a free
slot id or None; `free` returns one. Not thread-safe: owned by the scheduler-side
catalog, which runs on the engine-core thread.
"""
from __future__ import annotations


class SlotAllocator:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        # Pop from the end: low slot ids are handed out first.
        self._free = list(range(num_slots - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise KeyError(f"slot {slot} is not allocated")
        self._used.remove(slot)
        self._free.append(slot)
