"""A worker's block transfers to and from the slower tiers: NVMe records
(`RecordIO`) and the shared remote tier (`RemoteIO`).

`submit(plan)` hands a step's planned deletes, writes (of committed slots) and
reads (into promoted slots) to their I/O threads, never blocking the forward;
`drain()` collects what finished since: the completions the scheduler side
needs, and the blocks read back (their host slot, first token's position and
the surprisal their record carried), for the block index.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_sekv import compat
from vllm_sekv.config import SekvConfig
from vllm_sekv.protocol.metadata import nvme_layout, record_layout
from vllm_sekv.protocol.stats import SekvStats
from vllm_sekv.store.nvme import RecordIO
from vllm_sekv.store.remote import RedisStore
from vllm_sekv.store.remote_io import RemoteIO
from vllm_sekv.workspace.step_plan import StepPlan
from vllm_sekv.workspace.tenants import tenant_bytes

logger = logging.getLogger("vllm_sekv")


@dataclass
class BlockReadBack:
    """A block a slower tier returned into host slot `host_slot`."""

    host_slot: int
    start_token: int
    surprisal: np.ndarray | None  # per token, as its record carried it (None: none kept)


class TierTransfers:
    def __init__(self, records: RecordIO | None, remote: RemoteIO | None, block_tokens: int) -> None:
        self.records = records
        self.remote = remote
        self.block_tokens = block_tokens

    @classmethod
    def open(cls, config: SekvConfig, vllm_config: Any, pool: Any, scales: Any = None) -> "TierTransfers":
        """The configured tiers' I/O over the host pool `pool` (`[slots, ...]`)
        of this worker's rank (`scales`: an fp8 pool's, `HostPool.scales`,
        written and read with each record); a folder it cannot use fails
        start-up naming `nvme_dir`."""
        records = remote = None
        if not (config.nvme_dir or config.remote_url):
            return cls(records, remote, config.block_tokens)
        layout = record_layout(config, vllm_config, compat.worker_rank())
        if config.nvme_dir:
            try:
                records = RecordIO(nvme_layout(config, vllm_config), pool, layout, config.nvme_io_threads,
                                   sync=config.nvme_sync == "on", pool_scales=scales)
            except OSError as e:
                raise ValueError(f"sekv config 'nvme_dir': cannot use {config.nvme_dir}: {e}") from e
        if config.remote_url:
            store = RedisStore(config.remote_url, config.remote_io_timeout_ms / 1000, config.remote_ttl_s)
            remote = RemoteIO(store, pool, layout, config.remote_prefix, config.remote_io_threads)
        return cls(records, remote, config.block_tokens)

    def submit(self, plan: StepPlan) -> None:
        if self.records is not None:
            for block_hash in plan.nvme_deletes:
                self.records.delete_now(block_hash)
            for op in plan.nvme_writes:
                self.records.submit_write(op.host_slot, op.block_hash, op.start_token, tenant_bytes(op.tenant),
                                          plan.nvme_write_surprisal.get(op.host_slot))
            for op in plan.nvme_reads:
                self.records.submit_read(op.block_hash, op.host_slot, op.start_token, tenant_bytes(op.tenant))
        if self.remote is not None:
            self.remote.submit_writes([(op.host_slot, op.block_hash, op.start_token, tenant_bytes(op.tenant))
                                       for op in plan.remote_writes])
            self.remote.submit_reads([(op.host_slot, op.block_hash, op.start_token, tenant_bytes(op.tenant))
                                      for op in plan.remote_reads])

    def drain(self, stats: SekvStats) -> tuple[list[tuple[str, bytes, bool]], list[BlockReadBack]]:
        """The reads and writes finished since the last call: (kind, block
        hash, ok) of each, for the scheduler side, and the blocks read back.
        A failure is logged and counted: the block is a miss, recomputed."""
        done = (self.records.drain() if self.records is not None else []) + (
            self.remote.drain() if self.remote is not None else [])
        out, read_back = [], []
        for c in done:
            tier = "remote" if c.kind.startswith("remote") else "nvme"
            if c.ok and c.kind.endswith("read"):
                surprisal = c.surprisal if c.surprisal is not None and len(c.surprisal) == self.block_tokens else None
                read_back.append(BlockReadBack(c.host_slot, c.start_token, surprisal))
                stats.add(f"{tier}_read_blocks", 1)
            elif c.ok:
                stats.add(f"{tier}_written_blocks", 1)
            else:
                stats.add(f"{tier}_failures", 1)
                logger.warning("sekv %s: %s of block %s failed (%s); it is a miss and will be recomputed",
                               tier, c.kind.removeprefix("remote_"), c.block_hash.hex()[:16], c.reason)
            out.append((c.kind, c.block_hash, c.ok))
        return out, read_back

    def close(self) -> None:
        """Wait for every transfer in flight, then stop the I/O threads."""
        for io in (self.records, self.remote):
            if io is not None:
                io.drain(wait=True)
                io.close()
