"""The block catalog: which workspace blocks the tiers hold, and where.

A block is first *reserved* (a host slot is taken for a block whose tokens are
being computed and captured), then *committed* under its content hash once
every token was captured and the worker confirmed it; from then on it can be
matched. Reserved blocks are never matched. A committed block lives on the
host tier (`host_slot`), on the NVMe tier (`nvme`), or on both:

  * with an NVMe tier, a committed block is admitted there at once and written
    behind (state WRITING until the worker confirms, then STORED);
  * when the host tier is full, the host policy's victim loses its host copy:
    a STORED block stays matchable from NVMe, any other block is forgotten;
    blocks being written, read or restored (pinned) are never victims;
  * when the NVMe tier is full, the NVMe policy's victim loses its file (the
    catalog lists it in `take_deletes()`), and is forgotten if it has no host copy;
  * a matched NVMe-only block is *promoted*: it gets a host slot and stays
    `loading` until the worker's checked read is confirmed. A failed read
    forgets the NVMe copy: the block is a miss and vLLM recomputes it;
  * with a remote tier (a store several servers share), a committed block is
    also written there (`remote_writing` until the worker confirms; not a
    victim meanwhile). The catalog does not track what the remote store
    holds: a block found there at a match is added for the match
    (`add_remote`) and promoted at once like an NVMe-only one; a failed read
    forgets it.

Only blocks that are committed, on the host and not loading are restorable.

Every block belongs to a tenant (its tenant key). The catalog counts each
tenant's blocks (what a response may report to that tenant), and with a
tenant share set (`host_share`, `nvme_share`: most blocks one tenant may
hold on a tier, 0 = no limit) a tenant at its share makes room by evicting
its own least recently used block, never another tenant's.

Single-threaded: owned by the scheduler-side connector.
"""
from __future__ import annotations

import enum
import operator
from collections import Counter
from dataclasses import dataclass
from typing import Iterable

from vllm_sekv.store import SlotAllocator
from vllm_sekv.store.policy import EvictionPolicy, LRUPolicy


class NvmeState(enum.Enum):
    NONE = "none"
    WRITING = "writing"
    STORED = "stored"


@dataclass(eq=False)
class BlockRecord:
    start_token: int  # position of the block's first token in its sequence
    host_slot: int | None
    tenant: str = ""  # tenant key of the request that computed it
    block_hash: bytes | None = None  # set at commit
    committed: bool = False
    pins: int = 0
    nvme: NvmeState = NvmeState.NONE
    loading: bool = False  # host copy being read from NVMe or the remote tier
    remote: bool = False  # found in the remote tier (read from there when promoted)
    remote_writing: bool = False  # being written to the remote tier
    # Filled by the capture planner:
    captured_tokens: int = 0  # tokens whose capture was handed to the worker
    last_capture_step: int = -1  # engine step that captured the last of them

    @property
    def restorable(self) -> bool:
        return self.committed and self.host_slot is not None and not self.loading


@dataclass
class CatalogStats:
    committed_blocks: int = 0
    host_evictions: int = 0
    nvme_evictions: int = 0
    forgotten_blocks: int = 0
    reserve_failures: int = 0


class BlockCatalog:
    def __init__(
        self,
        num_host_slots: int,
        host_policy: EvictionPolicy,
        num_nvme_records: int = 0,
        nvme_policy: EvictionPolicy | None = None,
        host_share: int = 0,
        nvme_share: int = 0,
    ) -> None:
        self._slots = SlotAllocator(num_host_slots)
        self.host_share, self.nvme_share = host_share, nvme_share
        self._host_count: Counter[str] = Counter()  # tenant -> blocks with a host slot
        self._nvme_count: Counter[str] = Counter()  # tenant -> blocks with an NVMe record
        self._committed_count: Counter[str] = Counter()  # tenant -> matchable blocks
        self._host_policy = host_policy
        self._nvme_capacity = num_nvme_records
        self._nvme_policy = nvme_policy or LRUPolicy()
        self._nvme_used = 0
        self._by_hash: dict[bytes, BlockRecord] = {}
        self._by_slot: dict[int, BlockRecord] = {}
        self._deletes: list[bytes] = []
        self.stats = CatalogStats()

    # ------------------------------------------------------------- queries

    @property
    def nvme_enabled(self) -> bool:
        return self._nvme_capacity > 0

    @property
    def num_committed(self) -> int:
        return len(self._by_hash)

    @property
    def num_host_slots(self) -> int:
        return self._slots.num_slots

    @property
    def num_host_used(self) -> int:
        return self._slots.num_used

    @property
    def num_nvme_used(self) -> int:
        return self._nvme_used

    def tenant_blocks(self, tenant: str) -> int:
        """Matchable blocks of one tenant (on any tier)."""
        return self._committed_count[tenant]

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._by_hash

    def lookup(self, block_hash: bytes) -> BlockRecord | None:
        return self._by_hash.get(block_hash)

    def match_prefix(self, hashes: Iterable[bytes]) -> list[BlockRecord]:
        """Committed records (on any tier) of the longest prefix of `hashes`."""
        found = list(map(self._by_hash.get, hashes))  # one lookup each, without a Python loop
        return found[:found.index(None)] if None in found else found

    # ------------------------------------------------------------ host tier

    def reserve(self, start_token: int, tenant: str = "") -> BlockRecord | None:
        """Take a host slot for a block of `tenant` about to be captured; None
        if the host tier (or the tenant's share of it) holds nothing it may
        give up."""
        slot = self._take_host_slot(tenant)
        if slot is None:
            self.stats.reserve_failures += 1
            return None
        rec = BlockRecord(start_token=start_token, host_slot=slot, tenant=tenant)
        self._by_slot[slot] = rec
        self._host_count[tenant] += 1
        return rec

    def commit(self, rec: BlockRecord, block_hash: bytes) -> bool:
        """Make a reserved block matchable; with an NVMe tier, admit it there
        too (`rec.nvme` becomes WRITING: the caller has the worker write it).
        Returns False (and releases the slot) if an equal block is committed."""
        if rec.committed:
            raise ValueError(f"host slot {rec.host_slot} is already committed")
        if block_hash in self._by_hash:
            self.release(rec)
            return False
        rec.block_hash, rec.committed = block_hash, True
        self._by_hash[block_hash] = rec
        self._committed_count[rec.tenant] += 1
        self._host_policy.insert(block_hash)
        self.stats.committed_blocks += 1
        if self.nvme_enabled and self._take_nvme_record(rec.tenant):
            rec.nvme = NvmeState.WRITING
            self._nvme_policy.insert(block_hash)
            self._nvme_count[rec.tenant] += 1
        return True

    def release(self, rec: BlockRecord) -> None:
        """Give back a reserved (never committed) block's host slot."""
        if rec.committed:
            raise ValueError(f"host slot {rec.host_slot} is committed; it leaves by eviction only")
        if rec.host_slot is not None and self._by_slot.get(rec.host_slot) is rec:
            del self._by_slot[rec.host_slot]
            self._slots.free(rec.host_slot)
            self._host_count[rec.tenant] -= 1
            rec.host_slot = None

    def _take_host_slot(self, tenant: str) -> int | None:
        """A free host slot for `tenant`: a free one, else the host policy's
        victim's (the tenant's own once it holds its share)."""
        at_share = self.host_share and self._host_count[tenant] >= self.host_share
        slot = None if at_share else self._slots.allocate()
        if slot is not None:
            return slot
        victim = self._host_policy.victim(skip=self._skip_for(tenant if at_share else None))
        if victim is None:
            return None
        rec = self._by_hash[victim]
        self.stats.host_evictions += 1
        self._drop_host_copy(rec)
        if rec.nvme is not NvmeState.STORED:
            self._forget(rec)
        return self._slots.allocate()

    def _drop_host_copy(self, rec: BlockRecord) -> None:
        self._host_policy.remove(rec.block_hash)
        del self._by_slot[rec.host_slot]
        self._slots.free(rec.host_slot)
        self._host_count[rec.tenant] -= 1
        rec.host_slot = None

    @staticmethod
    def _busy(rec: BlockRecord) -> bool:
        return rec.pins > 0 or rec.loading or rec.nvme is NvmeState.WRITING or rec.remote_writing

    def _skip_for(self, tenant: str | None):
        """Which committed blocks a victim may not be: busy ones, and (for a
        tenant at its share) every other tenant's."""
        if tenant is None:
            return lambda h: self._busy(self._by_hash[h])
        return lambda h: self._busy(self._by_hash[h]) or self._by_hash[h].tenant != tenant

    # ------------------------------------------------------------ NVMe tier

    def add_stored(self, block_hash: bytes, start_token: int, tenant: str = "") -> BlockRecord | None:
        """Register a record found on disk at start-up (NVMe only). Over the
        NVMe budget the policy's victim goes (register oldest first); None, and
        the file listed for deletion, if nothing can go."""
        if block_hash in self._by_hash:
            return self._by_hash[block_hash]
        if not self._take_nvme_record(tenant):
            self._deletes.append(block_hash)
            return None
        rec = BlockRecord(start_token=start_token, host_slot=None, tenant=tenant, block_hash=block_hash,
                          committed=True, nvme=NvmeState.STORED)
        self._by_hash[block_hash] = rec
        self._committed_count[tenant] += 1
        self._nvme_count[tenant] += 1
        self._nvme_policy.insert(block_hash)
        return rec

    def add_remote(self, block_hash: bytes, start_token: int, tenant: str) -> BlockRecord | None:
        """A block the remote tier holds, for a match that will promote it
        (None if this catalog knows the hash already)."""
        if block_hash in self._by_hash:
            return None
        rec = BlockRecord(start_token=start_token, host_slot=None, tenant=tenant, block_hash=block_hash,
                          committed=True, remote=True)
        self._by_hash[block_hash] = rec
        self._committed_count[tenant] += 1
        return rec

    def drop_unpromoted(self, records: Iterable[BlockRecord]) -> None:
        """Forget remote records that a match added but could not promote."""
        for rec in records:
            if rec.remote and rec.host_slot is None and rec.nvme is NvmeState.NONE:
                self._forget(rec)

    def remote_write_done(self, block_hash: bytes) -> None:
        rec = self._by_hash.get(block_hash)
        if rec is not None:
            rec.remote_writing = False

    def write_done(self, block_hash: bytes, ok: bool) -> None:
        rec = self._by_hash.get(block_hash)
        if rec is None or rec.nvme is not NvmeState.WRITING:
            return
        if ok:
            rec.nvme = NvmeState.STORED
        else:
            self._drop_nvme_copy(rec, delete_file=False)

    def promote(self, rec: BlockRecord) -> bool:
        """Give an NVMe-only or remote block a host slot to be read into (it
        is `loading` until `read_done`). False if the host tier has no slot
        to give."""
        if rec.host_slot is not None or (rec.nvme is not NvmeState.STORED and not rec.remote):
            return rec.host_slot is not None
        rec.pins += 1  # not a victim while its slot is being taken
        slot = self._take_host_slot(rec.tenant)
        rec.pins -= 1
        if slot is None:
            return False
        rec.host_slot, rec.loading = slot, True
        self._by_slot[slot] = rec
        self._host_count[rec.tenant] += 1
        self._host_policy.insert(rec.block_hash)
        return True

    def read_done(self, block_hash: bytes, ok: bool) -> None:
        rec = self._by_hash.get(block_hash)
        if rec is None or not rec.loading:
            return
        rec.loading = False
        if not ok:  # the copy read is bad: forget it; the block is a miss
            self._drop_host_copy(rec)
            if rec.nvme is not NvmeState.NONE:
                self._drop_nvme_copy(rec, delete_file=True)
            else:
                self._forget(rec)

    def take_deletes(self) -> list[bytes]:
        out, self._deletes = self._deletes, []
        return out

    def _take_nvme_record(self, tenant: str) -> bool:
        at_share = self.nvme_share and self._nvme_count[tenant] >= self.nvme_share
        if not at_share and self._nvme_used < self._nvme_capacity:
            self._nvme_used += 1
            return True
        victim = self._nvme_policy.victim(skip=self._skip_for(tenant if at_share else None))
        if victim is None:
            return False
        self.stats.nvme_evictions += 1
        self._drop_nvme_copy(self._by_hash[victim], delete_file=True)
        self._nvme_used += 1
        return True

    def _drop_nvme_copy(self, rec: BlockRecord, delete_file: bool) -> None:
        self._nvme_policy.remove(rec.block_hash)
        rec.nvme = NvmeState.NONE
        self._nvme_used -= 1
        self._nvme_count[rec.tenant] -= 1
        if delete_file:
            self._deletes.append(rec.block_hash)
        if rec.host_slot is None:
            self._forget(rec)

    def _forget(self, rec: BlockRecord) -> None:
        if self._by_hash.pop(rec.block_hash, None) is not None:
            self._committed_count[rec.tenant] -= 1
        self.stats.forgotten_blocks += 1

    # --------------------------------------------------------------- uses

    def touch(self, records: Iterable[BlockRecord]) -> None:
        """Record a use (a restore) of committed blocks, for both policies
        (the NVMe one only with an NVMe tier: without, it orders nothing)."""
        keys = [rec.block_hash for rec in records]
        self._host_policy.touch_all(keys)
        if self.nvme_enabled:
            self._nvme_policy.touch_all(keys)

    @staticmethod
    def all_on_host(records: Iterable[BlockRecord]) -> bool:
        """Whether every record has a host copy (read in or still being read)."""
        return None not in map(operator.attrgetter("host_slot"), records)

    @staticmethod
    def any_loading(records: Iterable[BlockRecord]) -> bool:
        """Whether the host copy of some record is still being read in."""
        return any(map(operator.attrgetter("loading"), records))

    def pin(self, records: Iterable[BlockRecord]) -> None:
        for rec in records:
            rec.pins += 1

    def unpin(self, records: Iterable[BlockRecord]) -> None:
        for rec in records:
            rec.pins -= 1
            if rec.pins < 0:
                raise ValueError(f"block at host slot {rec.host_slot} unpinned more often than pinned")

    def repin(self, old: list[BlockRecord], new: list[BlockRecord]) -> None:
        """`unpin(old)` and `pin(new)`, leaving alone the records both start
        with (a request matched again for its next view pass: its whole
        history, 32K records at 1M tokens)."""
        n = min(len(old), len(new))
        shared = n if all(map(operator.is_, old[:n], new[:n])) else 0
        self.unpin(old[shared:])
        self.pin(new[shared:])
