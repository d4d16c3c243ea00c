"""Asynchronous record reads and writes between the host pool and the
remote tier (worker side; `store.remote` for the store).

`submit_writes` / `submit_reads` take a step's records and return at once;
batches of up to `batch_blocks` go to the store as one pipeline each, on a
thread pool. `drain()` returns the completions finished so far, in the NVMe
tier's `Completion` form (kinds "remote_write", "remote_read"). A slot handed
to a write must not change until its completion is drained; a slot handed to
a read holds the block only once its completion is drained as ok.

Reads check everything a record says (`store.records`: block, tenant, model,
position, layout, checksum) before the bytes reach the slot; a missing key,
a value that fails a check, a timeout or a store that is down is a failed
completion (a miss, recomputed). While the store is down (`RemoteHealth`),
batches fail at once instead of waiting for a timeout each. Never raises into
the forward pass.
"""
from __future__ import annotations

import logging
import torch

from vllm_sekv.store.io_jobs import IoJobs
from vllm_sekv.store.nvme import Completion
from vllm_sekv.store.records import (
    HEADER_BYTES, RecordError, RecordLayout, checksum_kind, pack_header, unpack_header, verify,
)
from vllm_sekv.store.remote import RemoteHealth, RemoteStore, RemoteUnavailable, record_key

logger = logging.getLogger("vllm_sekv")


class RemoteIO:
    def __init__(self, store: RemoteStore, pool_data: torch.Tensor, layout: RecordLayout, prefix: str,
                 threads: int = 2, batch_blocks: int = 4) -> None:
        self.store, self.pool, self.layout, self.prefix = store, pool_data, layout, prefix
        self.batch_blocks = batch_blocks
        self.health = RemoteHealth()
        self.checksum_kind = checksum_kind()
        self._jobs = IoJobs(threads, "sekv-remote")

    def _slot(self, host_slot: int) -> memoryview:
        return memoryview(self.pool[host_slot].view(torch.uint8).reshape(-1).numpy())

    def _key(self, block_hash: bytes) -> str:
        return record_key(self.prefix, block_hash, self.layout.rank)

    # ------------------------------------------------------------- public

    def submit_writes(self, ops: list[tuple[int, bytes, int, bytes]]) -> None:
        """(host slot, block hash, start token, tenant bytes) per record."""
        for i in range(0, len(ops), self.batch_blocks):
            self._jobs.submit(self._write, ops[i : i + self.batch_blocks])

    def submit_reads(self, ops: list[tuple[int, bytes, int, bytes]]) -> None:
        for i in range(0, len(ops), self.batch_blocks):
            self._jobs.submit(self._read, ops[i : i + self.batch_blocks])

    def drain(self, wait: bool = False) -> list[Completion]:
        return self._jobs.drain(wait)

    def close(self) -> None:
        self._jobs.close()

    # ----------------------------------------------------------- the I/O

    def _write(self, ops: list[tuple[int, bytes, int, bytes]]) -> list[Completion]:
        def failed(reason: str) -> list[Completion]:
            return [Completion("remote_write", h, False, slot, start, reason) for slot, h, start, _ in ops]

        if not self.health.up():
            return failed("the remote store is down (backing off)")
        values = {}
        for slot, block_hash, start, tenant in ops:
            payload = self._slot(slot)
            values[self._key(block_hash)] = pack_header(block_hash, tenant, start, self.layout, payload,
                                                        self.checksum_kind) + bytes(payload)
        try:
            self.store.put(values)
        except RemoteUnavailable as e:
            self.health.failed()
            return failed(str(e))
        self.health.ok()
        return [Completion("remote_write", h, True, slot, start) for slot, h, start, _ in ops]

    def _read(self, ops: list[tuple[int, bytes, int, bytes]]) -> list[Completion]:
        if not self.health.up():
            return [Completion("remote_read", h, False, slot, start, "the remote store is down (backing off)")
                    for slot, h, start, _ in ops]
        try:
            values = self.store.get([self._key(h) for _, h, _, _ in ops])
        except RemoteUnavailable as e:
            self.health.failed()
            return [Completion("remote_read", h, False, slot, start, str(e)) for slot, h, start, _ in ops]
        self.health.ok()
        out = []
        for (slot, block_hash, start, tenant), value in zip(ops, values):
            try:
                if value is None:
                    raise RecordError("not in the remote store (evicted, expired or flushed)")
                if len(value) != HEADER_BYTES + self.layout.payload_bytes:
                    raise RecordError(f"a value of {len(value)} bytes")
                head = unpack_header(value[:HEADER_BYTES], self.layout)
                if (head.block_hash, head.tenant, head.start_token) != (block_hash, tenant, start):
                    raise RecordError("the record is another block's")
                body = memoryview(value)[HEADER_BYTES:]
                verify(head, body)
                self._slot(slot)[:] = body
                out.append(Completion("remote_read", block_hash, True, slot, start))
            except RecordError as e:
                out.append(Completion("remote_read", block_hash, False, slot, start, str(e)))
        return out
