"""An NVMe folder's sessions and block files, for `vllm-sekv sessions`.

`model_folders(nvme_dir)` lists the folder's model folders (`fp-*`). Each
command (`cmd_list`, `cmd_delete`, `cmd_cleanup`) works on one model folder
whose lock the caller holds (`locked`: meanwhile no server uses the folder,
and a server refuses to start on it), and prints what it did.

* `cmd_delete` of a session removes the session and every block of its
  history and of the histories it forked away from that no other session
  lists; of a whole tenant (`session_id` None), every session and block file
  of the tenant, named or not (records carry their tenant key).
* `cmd_cleanup` removes sessions unused for longer than `older_than_s` and
  the block files no remaining session lists that are older than that, then
  the oldest block files until the folder holds at most `max_bytes`.

Bad input raises `ValueError` naming the option; `ERRORS` lists what a
command raises on a folder it cannot use (held by a server, damaged manifest).
"""
from __future__ import annotations

import os
import re
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from vllm_sekv.store.nvme import DirLock, NvmeLayout, NvmeDirInUse
from vllm_sekv.store.records import HEADER_BYTES, TENANT_OFFSET
from vllm_sekv.workspace.manifest import Manifest, ManifestError
from vllm_sekv.workspace.sessions import SessionTable
from vllm_sekv.workspace.tenants import SECRET_FILE, TenantKeys, read_secret, tenant_bytes

ERRORS = (ValueError, ManifestError, RuntimeError, NvmeDirInUse, OSError)
_AGE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")


def parse_age_s(text: str) -> float:
    """`30m`, `12h`, `7d` (or s) -> seconds; ValueError naming --older-than otherwise."""
    m = _AGE.match(text.strip())
    if not m:
        raise ValueError(f"--older-than: expected an age like 30m, 12h or 7d, got {text!r}")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def model_folders(nvme_dir: str) -> list[NvmeLayout]:
    """The model folders (`fp-*`) of an NVMe folder; ValueError if it is none."""
    root = Path(nvme_dir)
    if not root.is_dir():
        raise ValueError(f"--nvme-dir: {nvme_dir} is not a folder")
    return [NvmeLayout(root, d.name) for d in sorted(root.glob("fp-*")) if d.is_dir()]


def _load(layout: NvmeLayout) -> tuple[Manifest, SessionTable]:
    manifest = Manifest(layout.manifest, {}, sync=True)
    table = SessionTable(max_sessions=1 << 62)
    for ws in manifest.load():
        table.add(ws)
    return manifest, table


def _block_files(layout: NvmeLayout) -> list[Path]:
    return sorted(layout.blocks.glob("*/*.blk"))


def _listed(table: SessionTable) -> set[str]:
    return {h.hex() for ws in table for h in ws.block_hashes}


def _remove(paths: list[Path]) -> int:
    freed = 0
    for p in paths:
        try:
            freed += p.stat().st_size
            p.unlink()
        except FileNotFoundError:
            pass
    return freed


def _record_tenant(path: Path) -> bytes | None:
    """The tenant key a record's header names (None if unreadable)."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
    except OSError:
        return None
    return head[TENANT_OFFSET : TENANT_OFFSET + 16] if len(head) >= TENANT_OFFSET + 16 else None


def cmd_list(layout: NvmeLayout) -> None:
    manifest, table = _load(layout)
    files = _block_files(layout)
    size = sum(p.stat().st_size for p in files)
    print(f"{layout.root}  model={manifest.fingerprint.get('model', '?')}  "
          f"{len(files)} block files, {size / 2**20:.1f} MiB")
    for ws in sorted(table, key=lambda w: -w.last_used_s):
        age_h = (time.time() - ws.last_used_s) / 3600
        print(f"  {ws.session_id!r:<40.40} tokens={ws.num_tokens:<8} blocks={len(ws.block_hashes):<6} "
              f"forks={ws.num_forks:<3} idle={age_h:.1f}h tenant={ws.tenant[:8]}")
    manifest.close()


def cmd_delete(layout: NvmeLayout, tenant: str, session_id: str | None) -> int:
    """Sessions deleted: one (`session_id`) or all of the tenant's (None)."""
    manifest, table = _load(layout)
    gone = [ws for ws in table if ws.tenant == tenant and (session_id is None or ws.session_id == session_id)]
    for ws in gone:
        table.delete(ws.tenant, ws.session_id)
    still = _listed(table)
    if session_id is None:  # every record of the tenant, named or not
        key = tenant_bytes(tenant)
        doomed = [p for p in _block_files(layout)
                  if p.name.split(".")[0] not in still and _record_tenant(p) == key]
    else:
        owned = {h.hex() for ws in gone for h in (*ws.block_hashes, *ws.forked)} - still
        doomed = [p for p in _block_files(layout) if p.name.split(".")[0] in owned]
    freed = _remove(doomed)
    manifest.delete([(ws.tenant, ws.session_id) for ws in gone])
    manifest.close()
    if gone or doomed:
        what = f"session {session_id!r}" if session_id is not None else f"{len(gone)} sessions of the tenant"
        print(f"{layout.root}: deleted {what}: {len(doomed)} block files, {freed / 2**20:.1f} MiB")
    return len(gone) + len(doomed)


def cmd_cleanup(layout: NvmeLayout, older_than_s: float | None, max_bytes: int | None) -> None:
    manifest, table = _load(layout)
    now = time.time()
    dropped = []
    if older_than_s is not None:
        for ws in list(table):
            if now - ws.last_used_s > older_than_s:
                dropped.append(table.delete(ws.tenant, ws.session_id))
    still = _listed(table)
    files = _block_files(layout)
    doomed = []
    if older_than_s is not None:
        doomed = [p for p in files
                  if p.name.split(".")[0] not in still and now - p.stat().st_mtime > older_than_s]
    freed = _remove(doomed)
    changed = []
    if max_bytes is not None:
        rest = sorted((p for p in files if p not in set(doomed)), key=lambda p: p.stat().st_mtime)
        size = sum(p.stat().st_size for p in rest)
        extra = []
        while rest and size > max_bytes:
            p = rest.pop(0)
            size -= p.stat().st_size
            extra.append(p)
        freed += _remove(extra)
        doomed += extra
        gone = {p.name.split(".")[0] for p in extra}
        for ws in list(table):  # a session missing blocks is still valid up to them
            if any(h.hex() in gone for h in ws.block_hashes):
                ws.block_hashes = ws.block_hashes[: next(i for i, h in enumerate(ws.block_hashes)
                                                        if h.hex() in gone)]
                changed.append(ws)
    manifest.delete([(ws.tenant, ws.session_id) for ws in dropped])
    manifest.put(changed)
    manifest.close()
    print(f"{layout.root}: removed {len(doomed)} block files ({freed / 2**20:.1f} MiB), "
          f"{len(table)} sessions kept")


def tenant_keys(nvme_dir: str, hash_secret: str | None) -> TenantKeys:
    """The folder's tenant keys: from `hash_secret`, $SEKV_HASH_SECRET, else the folder's secret file."""
    secret = hash_secret or os.environ.get("SEKV_HASH_SECRET")
    if secret:
        return TenantKeys(secret.encode("utf-8"))
    path = Path(nvme_dir) / SECRET_FILE
    if not path.exists():
        raise ValueError(f"--nvme-dir: {nvme_dir} has no secret file; give the server's --hash-secret")
    return TenantKeys(read_secret(path))


@contextmanager
def locked(layout: NvmeLayout) -> Iterator[NvmeLayout]:
    """Hold the model folder's lock (NvmeDirInUse while a server holds it)."""
    lock = DirLock(layout.lock_path).acquire()
    try:
        yield layout
    finally:
        lock.release()
