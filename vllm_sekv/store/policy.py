"""Eviction policies over a tier's slots, kept apart from the tier mechanics.

A policy only orders keys; it never frees anything. The owner calls `insert`
when a block is admitted, `touch` when it is used again, `remove` when it
leaves, and asks `victim(skip)` for the next key to evict (`skip(key)` True
for keys that must stay, e.g. blocks being restored right now).

`SLRUPolicy` (segmented LRU) is the default: a new block enters a probation
segment; a block used again moves to a protected segment that may fill at most
`protected_fraction` of the capacity; victims come from probation first. So a
block recalled step after step survives a burst of new blocks, which only churn
probation. `LRUPolicy` is plain recency, for comparison.

Not thread-safe; owned by the scheduler-side catalog.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable, Hashable, Iterable, Protocol


class EvictionPolicy(Protocol):
    def insert(self, key: Hashable) -> None: ...
    def touch(self, key: Hashable) -> None: ...
    def touch_all(self, keys: Iterable[Hashable]) -> None: ...  # `touch` each, in order
    def remove(self, key: Hashable) -> None: ...
    def victim(self, skip: Callable[[Hashable], bool] = lambda k: False) -> Hashable | None: ...
    def __len__(self) -> int: ...


def _first_not_skipped(order: OrderedDict, skip: Callable[[Hashable], bool]) -> Hashable | None:
    for key in order:  # least recently used first
        if not skip(key):
            return key
    return None


class LRUPolicy:
    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def touch_all(self, keys: Iterable[Hashable]) -> None:
        order = self._order  # a session's whole history per step: no Python loop
        deque(map(order.move_to_end, filter(order.__contains__, keys)), maxlen=0)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victim(self, skip: Callable[[Hashable], bool] = lambda k: False) -> Hashable | None:
        return _first_not_skipped(self._order, skip)

    def __len__(self) -> int:
        return len(self._order)


class SLRUPolicy:
    def __init__(self, capacity: int, protected_fraction: float = 0.8) -> None:
        if not 0.0 <= protected_fraction <= 1.0:
            raise ValueError(f"protected_fraction must be in [0, 1], got {protected_fraction}")
        self._protected_cap = int(capacity * protected_fraction)
        self._probation: OrderedDict[Hashable, None] = OrderedDict()
        self._protected: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable) -> None:
        self._protected.pop(key, None)
        self._probation[key] = None
        self._probation.move_to_end(key)

    def touch(self, key: Hashable) -> None:
        if key in self._protected:
            self._protected.move_to_end(key)
            return
        if key not in self._probation:
            return
        del self._probation[key]
        self._protected[key] = None
        while len(self._protected) > self._protected_cap:
            demoted, _ = self._protected.popitem(last=False)
            self._probation[demoted] = None  # most recent end of probation

    def touch_all(self, keys: Iterable[Hashable]) -> None:
        protected = self._protected
        for key in keys:  # most often a block used again while protected: one move
            if key in protected:
                protected.move_to_end(key)
            else:
                self.touch(key)

    def remove(self, key: Hashable) -> None:
        self._probation.pop(key, None)
        self._protected.pop(key, None)

    def victim(self, skip: Callable[[Hashable], bool] = lambda k: False) -> Hashable | None:
        key = _first_not_skipped(self._probation, skip)
        return key if key is not None else _first_not_skipped(self._protected, skip)

    def is_protected(self, key: Hashable) -> bool:
        return key in self._protected

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)


def make_policy(name: str, capacity: int, protected_percent: int = 80) -> EvictionPolicy:
    if name == "slru":
        return SLRUPolicy(capacity, protected_percent / 100.0)
    if name == "lru":
        return LRUPolicy()
    raise ValueError(f"unknown eviction policy {name!r}; accepted: slru, lru")
