"""The planner's transfers to and from the slower tiers: what is queued for
the workers (NVMe writes and reads, remote writes and reads) and what they
have not reported yet.

Every rank holds its own share of a block: a transfer is done when every
rank reported it, or when one failed. A remote block that could not be read
is not offered again for a while (its key may hold a value that fails its
checks; the block computed again overwrites it). Single-threaded, on the
scheduler thread; no vLLM imports.
"""
from __future__ import annotations

import time
from typing import Sequence

from vllm_sekv.workspace.catalog import BlockCatalog, BlockRecord
from vllm_sekv.workspace.step_plan import RecordOp, StepPlan

REMOTE_MISS_HOLD_S = 60.0
_MAX_REMOTE_MISSES = 1 << 16


class TierQueues:
    def __init__(self, catalog: BlockCatalog, world_size: int = 1) -> None:
        self.catalog = catalog
        self.world_size = world_size
        self._writes: list[RecordOp] = []
        self._reads: list[RecordOp] = []
        self._remote_writes: list[RecordOp] = []
        self._remote_reads: list[RecordOp] = []
        self._pending: dict[tuple[str, bytes], int] = {}  # (kind, hash) -> ranks still to report
        self._writes_in_flight = 0  # of those, writes (NVMe or remote)
        self._remote_bad: dict[bytes, float] = {}  # hash -> until when it is not offered

    def queue_read(self, rec: BlockRecord) -> None:
        """Read `rec` (just promoted into a host slot) back from its tier."""
        op = RecordOp(rec.block_hash, rec.host_slot, rec.start_token, rec.tenant)
        kind = "remote_read" if rec.remote else "read"
        (self._remote_reads if rec.remote else self._reads).append(op)
        self._pending[(kind, rec.block_hash)] = self.world_size

    def queue_writes(self, rec: BlockRecord, nvme: bool, remote: bool) -> None:
        """Write just-committed `rec` behind: to NVMe if `nvme`, to the remote tier if `remote`."""
        op = RecordOp(rec.block_hash, rec.host_slot, rec.start_token, rec.tenant)
        if nvme:
            self._writes.append(op)
            self._pending[("write", rec.block_hash)] = self.world_size
            self._writes_in_flight += 1
        if remote:
            rec.remote_writing = True
            self._remote_writes.append(op)
            self._pending[("remote_write", rec.block_hash)] = self.world_size
            self._writes_in_flight += 1

    def fill(self, step: StepPlan) -> None:
        """Hand everything queued to the workers with `step`."""
        step.nvme_writes, self._writes = self._writes, []
        step.nvme_reads, self._reads = self._reads, []
        step.remote_writes, self._remote_writes = self._remote_writes, []
        step.remote_reads, self._remote_reads = self._remote_reads, []

    def offered_remote(self, hashes: Sequence[bytes]) -> list[bytes]:
        """The leading `hashes` worth asking the remote tier for (up to the
        first one whose read failed lately)."""
        now = time.monotonic()
        out = []
        for h in hashes:
            if self._remote_bad.get(h, 0.0) > now:
                break
            out.append(h)
        return out

    def has_pending_writes(self) -> bool:
        """Whether committed blocks still wait to be written to a tier (queued
        for the workers, or handed to them and not yet reported)."""
        return bool(self._writes or self._remote_writes or self._writes_in_flight)

    def done(self, completions: Sequence[tuple[str, bytes, bool]]) -> None:
        """Worker reports: (kind, block hash, ok), one per rank."""
        for kind, block_hash, ok in completions:
            key = (kind, block_hash)
            if key not in self._pending:
                continue
            self._pending[key] -= 1
            if ok and self._pending[key] > 0:
                continue  # other ranks still to report
            del self._pending[key]
            if kind in ("write", "remote_write"):
                self._writes_in_flight -= 1
            if kind == "write":
                self.catalog.write_done(block_hash, ok)
            elif kind in ("read", "remote_read"):
                self.catalog.read_done(block_hash, ok)
                if not ok and kind == "remote_read":
                    self._note_remote_miss(block_hash)
            elif kind == "remote_write":
                self.catalog.remote_write_done(block_hash)

    def _note_remote_miss(self, block_hash: bytes) -> None:
        if len(self._remote_bad) >= _MAX_REMOTE_MISSES:
            self._remote_bad.pop(next(iter(self._remote_bad)))
        self._remote_bad[block_hash] = time.monotonic() + REMOTE_MISS_HOLD_S
