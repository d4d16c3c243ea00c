"""Blocks kept on the device between restores: a view step moves over PCIe
only the blocks the previous steps did not bring.

Consecutive view steps of a session select mostly the same history blocks.
`ResidentBlocks` keeps device copies of recently restored host slots,
`data [capacity, 2, num_layers, block_tokens, kv_heads, head_dim]` in the host
tier's own dtype and layout (keys at their virtual positions, fp8 bytes under
an fp8 workspace, whose scales stay on the host): a restore writes a
resident block into the caches from its entry (or fills its staging rows
with a device copy instead of a host copy, `store.transfer`), through the
same re-RoPE and write as a moved block, so the result is the same, bit for
bit.

Which host slot an entry holds is bookkeeping on the host (`plan`, least
recently used first out); the entries' bytes are written on the restore
pipeline's copy stream and read there or on the compute stream, ordered by
the pipeline's events (`store.transfer`): no host synchronization is needed.
The owner must `drop` a host slot before anything rewrites it (captures,
NVMe and remote reads): an entry is never served stale.

Runs in the worker process, on the forward thread.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Collection, Iterable, Sequence

import torch


@dataclass(frozen=True)
class ResidentPlan:
    """One batch of a restore, split: `placed` = (batch index, entry) of
    blocks already resident; `moved` = batch indices of blocks to copy from
    the host; `admit` = (batch index, entry) of moved blocks to keep."""

    placed: list[tuple[int, int]]
    moved: list[int]
    admit: list[tuple[int, int]]


class ResidentBlocks:
    def __init__(self, capacity: int, block_shape: Sequence[int], dtype: torch.dtype,
                 device: torch.device | str) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.data = torch.empty((capacity, *block_shape), dtype=dtype, device=device)
        self._entry_of: OrderedDict[int, int] = OrderedDict()  # host slot -> entry, least recently used first
        self._free = list(range(capacity - 1, -1, -1))

    @property
    def capacity(self) -> int:
        return self.data.shape[0]

    def __contains__(self, host_slot: int) -> bool:
        return host_slot in self._entry_of

    def __len__(self) -> int:
        return len(self._entry_of)

    def plan(self, host_slots: Sequence[int], keep: Collection[int] = ()) -> ResidentPlan:
        """Split a batch of blocks (distinct host slots) into placed and moved
        ones, and give moved ones entries: free ones first, then those of the
        least recently used slots, never one of a slot in `keep` (the rest of
        the running restore, which it may still read: a set, for a restore
        of many batches) or of this batch."""
        placed, moved = [], []
        for i, slot in enumerate(host_slots):
            entry = self._entry_of.get(slot)
            if entry is None:
                moved.append(i)
            else:
                self._entry_of.move_to_end(slot)
                placed.append((i, entry))
        batch = set(host_slots)
        admit = []
        for i in moved:
            entry = self._take_entry(keep, batch)
            if entry is None:
                break
            self._entry_of[host_slots[i]] = entry
            admit.append((i, entry))
        return ResidentPlan(placed, moved, admit)

    def drop(self, host_slots: Iterable[int]) -> None:
        """Forget these host slots' copies (they are about to be rewritten)."""
        for slot in host_slots:
            entry = self._entry_of.pop(int(slot), None)
            if entry is not None:
                self._free.append(entry)

    def _take_entry(self, keep: Collection[int], batch: set[int]) -> int | None:
        if self._free:
            return self._free.pop()
        for slot in self._entry_of:  # least recently used first
            if slot not in keep and slot not in batch:
                return self._entry_of.pop(slot)
        return None
