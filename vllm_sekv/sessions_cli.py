"""`vllm-sekv sessions ...`: inspect and clean an NVMe folder while no server uses it.

  vllm-sekv sessions list    --nvme-dir DIR
  vllm-sekv sessions delete  --nvme-dir DIR SESSION_ID [--cache-salt SALT]
  vllm-sekv sessions delete  --nvme-dir DIR --all-of-tenant [--cache-salt SALT]
  vllm-sekv sessions cleanup --nvme-dir DIR [--older-than 7d] [--max-bytes 100G]

Each command takes the folder's lock, so it refuses to run while a server uses
the folder (and a server refuses to start while a command runs). A tenant is
named by its `cache_salt` (default: none), turned into its tenant key with the
folder's secret (`--hash-secret`, or SEKV_HASH_SECRET, if the server was given
one). `delete SESSION_ID` removes the session, every block of its history and
of the histories it forked away from that no other session lists.
`--all-of-tenant` removes every session and every block of the tenant, named
or not (records carry their tenant key). `cleanup` removes sessions unused for
longer than `--older-than` and the block files no remaining session lists that
are older than that, then the oldest block files until the folder holds at
most `--max-bytes`.
"""
from __future__ import annotations

import argparse
import os
import re
import time
from pathlib import Path

from vllm_sekv.config import parse_size_bytes
from vllm_sekv.store.nvme import DirLock, NvmeLayout, NvmeDirInUse
from vllm_sekv.store.records import HEADER_BYTES, TENANT_OFFSET
from vllm_sekv.workspace.manifest import Manifest, ManifestError
from vllm_sekv.workspace.sessions import SessionTable
from vllm_sekv.workspace.tenants import SECRET_FILE, TenantKeys, read_secret, tenant_bytes

_AGE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")


def parse_age_s(text: str) -> float:
    m = _AGE.match(text.strip())
    if not m:
        raise ValueError(f"--older-than: expected an age like 30m, 12h or 7d, got {text!r}")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def _folders(nvme_dir: str) -> list[NvmeLayout]:
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


def _tenant_keys(nvme_dir: str, hash_secret: str | None) -> TenantKeys:
    secret = hash_secret or os.environ.get("SEKV_HASH_SECRET")
    if secret:
        return TenantKeys(secret.encode("utf-8"))
    path = Path(nvme_dir) / SECRET_FILE
    if not path.exists():
        raise ValueError(f"--nvme-dir: {nvme_dir} has no secret file; give the server's --hash-secret")
    return TenantKeys(read_secret(path))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="vllm-sekv sessions", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="action", required=True)
    for name, help_text in (("list", "list the sessions of each model folder"),
                            ("delete", "delete a session, or every session and block of a tenant"),
                            ("cleanup", "delete idle sessions and old blocks")):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--nvme-dir", required=True, help="the server's nvme_dir")
        if name == "delete":
            p.add_argument("session_id", nargs="?", help="the session to delete")
            p.add_argument("--all-of-tenant", action="store_true",
                           help="delete every session and block of the tenant instead")
            p.add_argument("--cache-salt", default="", help="the tenant's cache_salt, if any")
            p.add_argument("--hash-secret", default=None, help="the server's hash_secret, if it was given one")
        if name == "cleanup":
            p.add_argument("--older-than", default=None, help="e.g. 12h, 7d")
            p.add_argument("--max-bytes", default=None, help="e.g. 100G")
    args = ap.parse_args(argv)
    try:
        if args.action == "delete" and (args.session_id is None) == (not args.all_of_tenant):
            raise ValueError("delete: give a SESSION_ID or --all-of-tenant (not both)")
        layouts = _folders(args.nvme_dir)
        older = parse_age_s(args.older_than) if getattr(args, "older_than", None) else None
        max_bytes = (parse_size_bytes("--max-bytes", args.max_bytes)
                     if getattr(args, "max_bytes", None) else None)
        tenant = (_tenant_keys(args.nvme_dir, args.hash_secret).of(args.cache_salt)
                  if args.action == "delete" else "")
        found = 0
        for layout in layouts:
            lock = DirLock(layout.lock_path).acquire()
            try:
                if args.action == "list":
                    cmd_list(layout)
                elif args.action == "delete":
                    found += cmd_delete(layout, tenant, args.session_id)
                else:
                    cmd_cleanup(layout, older, max_bytes)
            finally:
                lock.release()
        if args.action == "delete" and not found:
            print(f"nothing of {'session ' + repr(args.session_id) if args.session_id else 'that tenant'} "
                  f"in {args.nvme_dir}")
            return 1
    except (ValueError, ManifestError, RuntimeError, NvmeDirInUse, OSError) as e:
        print(f"vllm-sekv sessions: {e}")
        return 2
    return 0
