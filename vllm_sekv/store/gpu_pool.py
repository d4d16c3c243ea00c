"""GPU-resident pool of recently used raw workspace blocks (CUDA tier).

A connector-owned cache of whole workspace blocks in the host pool's slot
layout `[capacity_blocks, 2, num_layers, block_tokens, kv_heads, head_dim]`, keyed
by workspace block id, evicted least-recently-used. Consecutive agent steps
select overlapping block sets; `diff(selected)` says which of them are already
here (`resident`, with their rows) and which must come from the host
(`incoming`), so a step moves only the missing blocks. The rows of this pool are
what the restore pipeline scatters from (`scatter_rerope(..., src_rows=rows)`),
and the landing place of incoming blocks' host->device copies.

Bookkeeping (`LruRows`) is pure Python and separate from the bytes
(`GpuBlockPool.data`). All methods run on the caller's thread, never block on
the device, and mutate only the pool's own bookkeeping; the caller orders the
device work (a row handed out by `admit` may still be read by a scatter of an
earlier step: enqueue the new copy on the same stream or after that scatter's
event). Errors raise ValueError (bad arguments) or RuntimeError (capacity).
No vLLM imports.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch


@dataclass
class PoolDiff:
    """Split of a selection against the pool (both lists follow the selection order).

    resident: (block_id, row) pairs already in the pool.
    incoming: block ids that must be copied in.
    """

    resident: list[tuple[int, int]] = field(default_factory=list)
    incoming: list[int] = field(default_factory=list)


class LruRows:
    """Block id -> row bookkeeping with LRU eviction over a fixed number of rows."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._rows: OrderedDict[int, int] = OrderedDict()  # oldest first
        self._free_rows: list[int] = list(range(capacity_blocks - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._rows

    def row_of(self, block_id: int) -> int | None:
        return self._rows.get(block_id)

    def diff(self, selected: Iterable[int]) -> PoolDiff:
        """Split `selected` into resident and incoming. Pure: changes nothing."""
        out = PoolDiff()
        seen: set[int] = set()
        for block_id in selected:
            if block_id in seen:
                raise ValueError(f"block {block_id} selected twice")
            seen.add(block_id)
            row = self._rows.get(block_id)
            if row is None:
                out.incoming.append(block_id)
            else:
                out.resident.append((block_id, row))
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Mark resident blocks as most recently used (unknown ids are ignored)."""
        for block_id in block_ids:
            if block_id in self._rows:
                self._rows.move_to_end(block_id)

    def admit(self, block_ids: Sequence[int], protected: Iterable[int] = ()) -> list[int]:
        """Give each (non-resident) block a row, evicting LRU blocks not in `protected`.

        Returns the rows, in order. Raises RuntimeError, changing nothing, when
        the free rows plus the evictable ones are too few.
        """
        if len(set(block_ids)) != len(block_ids):
            raise ValueError("admit got duplicate block ids")
        already = [b for b in block_ids if b in self._rows]
        if already:
            raise ValueError(f"blocks already resident: {already[:8]}")
        keep = set(protected)
        need = len(block_ids) - len(self._free_rows)
        victims: list[int] = []
        if need > 0:
            for block_id in self._rows:  # oldest first
                if block_id not in keep:
                    victims.append(block_id)
                    if len(victims) == need:
                        break
            if len(victims) < need:
                raise RuntimeError(
                    f"GPU pool too small: {len(block_ids)} incoming, {len(self._free_rows)} free, "
                    f"{len(victims)} evictable of capacity {self.capacity_blocks}"
                )
        for block_id in victims:
            self._free_rows.append(self._rows.pop(block_id))
        rows = []
        for block_id in block_ids:
            row = self._free_rows.pop()
            self._rows[block_id] = row
            rows.append(row)
        return rows

    def invalidate(self, block_ids: Iterable[int]) -> None:
        """Drop blocks (e.g. their workspace block was rewritten); frees their rows."""
        for block_id in block_ids:
            row = self._rows.pop(block_id, None)
            if row is not None:
                self._free_rows.append(row)


class GpuBlockPool:
    """`LruRows` bookkeeping plus the device tensor `data` that holds the blocks.

    block_shape: one slot of the host pool, `[2, num_layers, block_tokens,
    kv_heads, head_dim]`. Allocates `capacity_blocks * block_bytes` on `device`
    at construction (torch.empty; contents undefined until written).
    """

    def __init__(self, capacity_blocks: int, block_shape: Sequence[int], dtype: torch.dtype,
                 device: torch.device | str) -> None:
        if len(block_shape) != 5 or block_shape[0] != 2:
            raise ValueError(f"block_shape must be [2, layers, block_tokens, kv_heads, head_dim], got {block_shape}")
        self.index = LruRows(capacity_blocks)
        self.data = torch.empty((capacity_blocks, *block_shape), dtype=dtype, device=device)

    @property
    def capacity_blocks(self) -> int:
        return self.index.capacity_blocks

    @property
    def block_bytes(self) -> int:
        return self.data[0].numel() * self.data.element_size() if self.capacity_blocks else 0

    def diff(self, selected: Iterable[int]) -> PoolDiff:
        return self.index.diff(selected)

    def admit(self, block_ids: Sequence[int], protected: Iterable[int] = ()) -> list[int]:
        return self.index.admit(block_ids, protected)

    def touch(self, block_ids: Iterable[int]) -> None:
        self.index.touch(block_ids)

    def invalidate(self, block_ids: Iterable[int]) -> None:
        self.index.invalidate(block_ids)

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.index
