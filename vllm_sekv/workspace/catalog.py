"""The block catalog: which workspace blocks the host tier holds, and where.

A block is first *reserved* (a slot is taken for a block whose tokens are
being computed and captured), then *committed* under its content hash once
every token was captured and the worker confirmed it, and from then on can be
matched and restored. Reserved blocks are never matched. A block can be
*pinned* while a restore reads it; pinned blocks are never evicted.

When the tier is full, `reserve` evicts the policy's victim among committed,
unpinned blocks. Eviction only forgets a block: a later match simply ends
before it (a miss, recomputed by vLLM).

Single-threaded: owned by the scheduler-side connector.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from vllm_sekv.store import SlotAllocator
from vllm_sekv.store.policy import EvictionPolicy


@dataclass(eq=False)
class BlockRecord:
    slot: int
    start_token: int  # position of the block's first token in its sequence
    block_hash: bytes | None = None  # set at commit
    committed: bool = False
    pins: int = 0
    # Filled by the capture planner:
    captured_tokens: int = 0  # tokens whose capture was handed to the worker
    last_capture_step: int = -1  # engine step that captured the last of them


@dataclass
class CatalogStats:
    committed_blocks: int = 0
    evicted_blocks: int = 0
    reserve_failures: int = 0


class BlockCatalog:
    def __init__(self, num_slots: int, policy: EvictionPolicy) -> None:
        self._slots = SlotAllocator(num_slots)
        self._policy = policy
        self._by_hash: dict[bytes, BlockRecord] = {}
        self._by_slot: dict[int, BlockRecord] = {}
        self.stats = CatalogStats()

    @property
    def num_slots(self) -> int:
        return self._slots.num_slots

    @property
    def num_committed(self) -> int:
        return len(self._by_hash)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._by_hash

    def lookup(self, block_hash: bytes) -> BlockRecord | None:
        return self._by_hash.get(block_hash)

    def match_prefix(self, hashes: Iterable[bytes]) -> list[BlockRecord]:
        """Committed records of the longest prefix of `hashes` held here."""
        out = []
        for h in hashes:
            rec = self._by_hash.get(h)
            if rec is None:
                break
            out.append(rec)
        return out

    def reserve(self, start_token: int) -> BlockRecord | None:
        """Take a slot for a block about to be captured; None if the tier is
        full of pinned or reserved blocks."""
        slot = self._slots.allocate()
        if slot is None:
            victim = self._policy.victim(skip=lambda s: self._by_slot[s].pins > 0)
            if victim is None:
                self.stats.reserve_failures += 1
                return None
            self._drop(self._by_slot[victim])
            self.stats.evicted_blocks += 1
            slot = self._slots.allocate()
            assert slot is not None
        rec = BlockRecord(slot=slot, start_token=start_token)
        self._by_slot[slot] = rec
        return rec

    def commit(self, rec: BlockRecord, block_hash: bytes) -> bool:
        """Make a reserved block matchable. Returns False (and releases the
        slot) if an equal block was committed meanwhile."""
        if rec.committed:
            raise ValueError(f"slot {rec.slot} is already committed")
        if block_hash in self._by_hash:
            self.release(rec)
            return False
        rec.block_hash, rec.committed = block_hash, True
        self._by_hash[block_hash] = rec
        self._policy.insert(rec.slot)
        self.stats.committed_blocks += 1
        return True

    def release(self, rec: BlockRecord) -> None:
        """Give back a reserved (never committed) block's slot."""
        if rec.committed:
            raise ValueError(f"slot {rec.slot} is committed; it leaves by eviction only")
        if self._by_slot.get(rec.slot) is rec:
            del self._by_slot[rec.slot]
            self._slots.free(rec.slot)

    def touch(self, records: Iterable[BlockRecord]) -> None:
        """Record a use (a restore) of committed blocks, for the policy."""
        for rec in records:
            self._policy.touch(rec.slot)

    def pin(self, records: Iterable[BlockRecord]) -> None:
        for rec in records:
            rec.pins += 1

    def unpin(self, records: Iterable[BlockRecord]) -> None:
        for rec in records:
            rec.pins -= 1
            if rec.pins < 0:
                raise ValueError(f"slot {rec.slot} unpinned more often than pinned")

    def _drop(self, rec: BlockRecord) -> None:
        self._policy.remove(rec.slot)
        if rec.block_hash is not None:
            self._by_hash.pop(rec.block_hash, None)
        del self._by_slot[rec.slot]
        self._slots.free(rec.slot)
