"""The manifest: which sessions an NVMe folder's blocks form, in SQLite.

`<folder>/manifest.sqlite` (owner-only, WAL journal) holds one row per named
session: its tenant key, session id, token count, forks, last use, the block
hashes of its last history and those of the histories it forked away from
(so that deleting a session deletes all of it). A `meta` table holds the
format version and the model fingerprint. A session's row is rewritten when
its request finishes: the cost is that row, not the whole manifest.

Durability: with `sync` (config `nvme_sync` on) every transaction is on disk
when it commits (SQLite `synchronous=FULL`); without, a power loss may lose
the last transactions, never corrupt the file. The manifest only names
sessions: blocks are found by scanning the folder, so a manifest that is
missing, damaged or from another format is set aside (`ManifestError`, the
caller logs it) and every block stays restorable by content.

`Manifest` is blocking, for one thread (the sessions command, tests).
`ManifestWriter` runs one on its own thread for the server: the scheduler
thread hands it snapshots of changed sessions and never waits.
"""
from __future__ import annotations

import json
import logging
import math
import os
import queue
import sqlite3
import threading
import time
from pathlib import Path
from typing import Iterable

from vllm_sekv.workspace.sessions import Workspace

logger = logging.getLogger("vllm_sekv")

FORMAT_VERSION = 2
HASH_BYTES = 16
_COLUMNS = "tenant, session_id, num_tokens, num_forks, last_used_s, blocks, forked"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sessions (
    tenant TEXT NOT NULL, session_id TEXT NOT NULL, num_tokens INTEGER NOT NULL,
    num_forks INTEGER NOT NULL, last_used_s REAL NOT NULL, blocks BLOB NOT NULL, forked BLOB NOT NULL,
    PRIMARY KEY (tenant, session_id));
"""


class ManifestError(ValueError):
    pass


def _pack(hashes: Iterable[bytes]) -> bytes:
    return b"".join(hashes)


def _unpack(blob: bytes) -> list[bytes]:
    if not isinstance(blob, bytes) or len(blob) % HASH_BYTES:
        raise ManifestError("a block list is not a whole number of hashes")
    return [blob[i : i + HASH_BYTES] for i in range(0, len(blob), HASH_BYTES)]


class Manifest:
    """One folder's manifest. Raises ManifestError on a file it cannot use."""

    def __init__(self, path: Path, fingerprint: dict, sync: bool = True) -> None:
        self.path = Path(path)
        new = not self.path.exists()
        try:
            if new:  # created owner-only (SQLite would follow the umask)
                os.close(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(f"PRAGMA synchronous={'FULL' if sync else 'OFF'}")
            self._db.executescript(_SCHEMA)
            meta = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
            self._db.execute(f"SELECT {_COLUMNS} FROM sessions LIMIT 0")  # a foreign table fails here
        except (sqlite3.Error, OSError) as e:
            self._close_quietly()
            raise ManifestError(f"{self.path}: {e}") from e
        if not meta:
            self._db.executemany("INSERT INTO meta VALUES (?, ?)",
                                 [("format_version", str(FORMAT_VERSION)), ("fingerprint", json.dumps(fingerprint))])
        elif meta.get("format_version") != str(FORMAT_VERSION):
            self._close_quietly()
            raise ManifestError(f"{self.path}: format version {meta.get('format_version')!r}, "
                                f"expected {FORMAT_VERSION}")
        self.fingerprint = fingerprint if not meta else _json_or_empty(meta.get("fingerprint"))

    def load(self) -> list[Workspace]:
        """Every session; rows that do not read back are skipped (logged)."""
        out = []
        try:
            rows = self._db.execute(f"SELECT {_COLUMNS} FROM sessions").fetchall()
        except sqlite3.Error as e:
            raise ManifestError(f"{self.path}: {e}") from e
        for tenant, session_id, num_tokens, num_forks, last_used_s, blocks, forked in rows:
            try:
                if not (isinstance(tenant, str) and isinstance(session_id, str)):
                    raise ManifestError("tenant and session id must be text")
                if not math.isfinite(float(last_used_s)):
                    raise ManifestError("last use is not a time")
                ws = Workspace(tenant, session_id, _unpack(blocks), int(num_tokens), int(num_forks),
                               float(last_used_s))
                ws.forked = set(_unpack(forked))
            except (ManifestError, TypeError, ValueError, OverflowError) as e:
                logger.warning("sekv nvme: skipping a manifest row of %s: %s", self.path, e)
                continue
            out.append(ws)
        return out

    def put(self, workspaces: Iterable[Workspace]) -> None:
        """Write these sessions' rows (one transaction)."""
        rows = [(ws.tenant, ws.session_id, ws.num_tokens, ws.num_forks, ws.last_used_s, _pack(ws.block_hashes),
                 _pack(sorted(ws.forked))) for ws in workspaces]
        with self._transaction():
            self._db.executemany("INSERT OR REPLACE INTO sessions VALUES (?, ?, ?, ?, ?, ?, ?)", rows)

    def delete(self, keys: Iterable[tuple[str, str]]) -> None:
        with self._transaction():
            self._db.executemany("DELETE FROM sessions WHERE tenant = ? AND session_id = ?", list(keys))

    def close(self) -> None:
        self._close_quietly()

    def _transaction(self):
        db = self._db

        class _Tx:
            def __enter__(self):
                db.execute("BEGIN IMMEDIATE")

            def __exit__(self, kind, exc, tb):
                db.execute("COMMIT" if kind is None else "ROLLBACK")
                return False

        return _Tx()

    def _close_quietly(self) -> None:
        db = getattr(self, "_db", None)
        if db is not None:
            try:
                db.close()
            except sqlite3.Error:
                pass
            self._db = None


def _json_or_empty(text: str | None) -> dict:
    try:
        value = json.loads(text or "{}")
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def open_or_set_aside(path: Path, fingerprint: dict, sync: bool) -> Manifest:
    """The folder's manifest; one that cannot be used is renamed aside
    (`<name>.unreadable-<time>`, logged) and a new, empty one started."""
    try:
        return Manifest(path, fingerprint, sync)
    except ManifestError as e:
        aside = path.with_name(f"{path.name}.unreadable-{int(time.time())}")
        logger.warning("sekv nvme: setting the manifest aside as %s (%s); its blocks stay restorable", aside.name, e)
        for suffix in ("", "-wal", "-shm"):
            try:
                os.replace(f"{path}{suffix}", f"{aside}{suffix}")
            except FileNotFoundError:
                pass
        return Manifest(path, fingerprint, sync)


class ManifestWriter:
    """Writes session changes behind, on a thread of its own.

    `put(ws)` snapshots a session (its hashes are copied) and returns at once;
    `delete(key)` likewise. Changes to one session are coalesced: only its
    latest state is written. `flush()` waits until everything handed over is
    written; `close()` flushes and stops. A write that fails is logged (the
    next change of that session writes it again); it never reaches the
    scheduler thread."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="sekv-manifest", daemon=True)
        self._thread.start()

    def put(self, ws: Workspace) -> None:
        snapshot = Workspace(ws.tenant, ws.session_id, list(ws.block_hashes), ws.num_tokens, ws.num_forks,
                             ws.last_used_s)
        snapshot.forked = set(ws.forked)
        self._queue.put(("put", snapshot))

    def delete(self, key: tuple[str, str]) -> None:
        self._queue.put(("delete", key))

    def flush(self) -> None:
        done = threading.Event()
        self._queue.put(("flush", done))
        done.wait()

    def close(self) -> None:
        if self._thread.is_alive():
            self.flush()
            self._queue.put(("stop", None))
            self._thread.join()
        self.manifest.close()

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while True:  # take whatever else is waiting: one transaction for it all
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            puts: dict[tuple[str, str], Workspace] = {}
            deletes: set[tuple[str, str]] = set()
            waiters, stop = [], False
            for kind, item in batch:
                if kind == "put":
                    puts[(item.tenant, item.session_id)] = item
                    deletes.discard((item.tenant, item.session_id))
                elif kind == "delete":
                    puts.pop(item, None)
                    deletes.add(item)
                elif kind == "flush":
                    waiters.append(item)
                else:
                    stop = True
            try:
                if puts:
                    self.manifest.put(puts.values())
                if deletes:
                    self.manifest.delete(deletes)
            except (sqlite3.Error, ManifestError, AttributeError) as e:
                logger.warning("sekv nvme: could not write the manifest: %s", e)
            for done in waiters:
                done.set()
            if stop:
                return
