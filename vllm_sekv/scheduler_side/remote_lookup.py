"""The remote tier, scheduler side: what the shared store holds for a prompt,
and the named sessions' rows there.

`RemoteTier.lookup(hashes, tenant, session_id)` answers the planner's
question at a match: how many of these block hashes (in order, after what
this server holds) the store holds. A named session's row (written by
whichever server served its last step) lists its history's blocks: the
prompt's blocks it shares with that row are taken as held without asking
for each; the rest are asked for in pipelined batches, up to the first
missing one. Every answer is a claim only: a block is served after the
worker's read checked its record.

A lookup takes about `remote_timeout_ms` at most (each call is bounded by it,
and no batch starts after it); a store that is down or slow
answers "none" (the blocks are prefilled) and is not asked again for a
back-off (`RemoteHealth`). Session rows are written behind on a thread of
their own (`put_session`); their keys are keyed digests (`TenantKeys`), and
they hold block hashes and a token count, never a session id or a salt.

Runs in the engine-core process: `lookup` on the scheduler thread.
"""
from __future__ import annotations

import logging
import queue
import struct
import threading
import time

from vllm_sekv.config import SekvConfig
from vllm_sekv.store.remote import RedisStore, RemoteHealth, RemoteUnavailable, record_key, session_key
from vllm_sekv.workspace.sessions import Workspace
from vllm_sekv.workspace.tenants import TenantKeys

logger = logging.getLogger("vllm_sekv")

_ROW = struct.Struct("<Q")  # a session row: its token count, then its block hashes
LOOKUP_BATCH = 512


class RemoteTier:
    def __init__(self, config: SekvConfig, tenants: TenantKeys, store: RedisStore | None = None) -> None:
        self.prefix = config.remote_prefix
        self.budget_s = config.remote_timeout_ms / 1000
        self.tenants = tenants
        self.store = store or RedisStore(config.remote_url, config.remote_timeout_ms / 1000, config.remote_ttl_s)
        self.health = RemoteHealth()
        self.failures = 0
        self._rows: queue.Queue = queue.Queue(maxsize=4096)
        self._writer = threading.Thread(target=self._write_rows, name="sekv-remote-sessions", daemon=True)
        self._writer.start()

    def lookup(self, hashes: list[bytes], tenant: str, session_id: str | None) -> int:
        """How many leading `hashes` the store holds (0 while it is down)."""
        if not hashes or not self.health.up():
            return 0
        try:
            deadline = time.monotonic() + self.budget_s
            known = 0
            if session_id is not None:
                row = self.store.get([self._session_key(tenant, session_id)])[0]
                for ours, theirs in zip(hashes, _row_hashes(row)):
                    if ours != theirs:
                        break
                    known += 1
            while known < len(hashes):
                batch = hashes[known : known + LOOKUP_BATCH]
                held = self.store.contains([record_key(self.prefix, h, 0) for h in batch])
                run = next((i for i, ok in enumerate(held) if not ok), len(held))
                known += run
                if run < len(batch) or time.monotonic() > deadline:  # the rest: prefilled, not waited for
                    break
            self.health.ok()
            return known
        except RemoteUnavailable as e:
            self._failed("lookup", e)
            return 0

    def put_session(self, ws: Workspace) -> None:
        """Write a named session's row behind (never waits; dropped if the
        writer is that far behind)."""
        value = _ROW.pack(ws.num_tokens) + b"".join(ws.block_hashes)
        try:
            self._rows.put_nowait((self._session_key(ws.tenant, ws.session_id), value))
        except queue.Full:
            pass

    def close(self) -> None:
        self._rows.put(None)
        self._writer.join(timeout=5)
        self.store.close()

    def _session_key(self, tenant: str, session_id: str) -> str:
        return session_key(self.prefix, tenant, self.tenants.session_digest(tenant, session_id))

    def _write_rows(self) -> None:
        while True:
            item = self._rows.get()
            if item is None:
                return
            batch = {item[0]: item[1]}
            while not self._rows.empty() and len(batch) < 256:
                nxt = self._rows.get()
                if nxt is None:
                    self._rows.put(None)
                    break
                batch[nxt[0]] = nxt[1]
            if not self.health.up():
                continue
            try:
                self.store.put(batch)
                self.health.ok()
            except RemoteUnavailable as e:
                self._failed("session write", e)

    def _failed(self, what: str, e: Exception) -> None:
        self.failures += 1
        backoff = self.health.failed()
        logger.warning("sekv remote: %s failed (%s); treated as a miss, the store is not asked again "
                       "for %.1f s", what, e, backoff)


def _row_hashes(row: bytes | None) -> list[bytes]:
    if not row or len(row) < _ROW.size or (len(row) - _ROW.size) % 16:
        return []
    return [row[i : i + 16] for i in range(_ROW.size, len(row), 16)]
