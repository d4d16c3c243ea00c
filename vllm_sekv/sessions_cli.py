"""`vllm-sekv sessions ...`: inspect and clean an NVMe folder while no server uses it.

  vllm-sekv sessions list    --nvme-dir DIR
  vllm-sekv sessions delete  --nvme-dir DIR SESSION_ID [--cache-salt SALT]
  vllm-sekv sessions cleanup --nvme-dir DIR [--older-than 7d] [--max-bytes 100G]

Each command takes the folder's lock, so it refuses to run while a server uses
the folder (and a server refuses to start while a command runs). `delete`
removes the session and every block file no other session lists. `cleanup`
removes sessions unused for longer than `--older-than` and the block files no
remaining session lists that are older than that, then the oldest block files
until the folder holds at most `--max-bytes`.
"""
from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

from vllm_sekv.config import parse_size_bytes
from vllm_sekv.store.nvme import DirLock, NvmeLayout
from vllm_sekv.workspace.manifest import ManifestError, read_manifest, write_manifest
from vllm_sekv.workspace.sessions import SessionTable, salt_digest

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


def _load(layout: NvmeLayout) -> tuple[dict, SessionTable]:
    table = SessionTable()
    fingerprint: dict = {}
    if layout.manifest.exists():
        fingerprint, workspaces = read_manifest(layout.manifest)
        for ws in workspaces:
            table.add(ws)
    return fingerprint, table


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


def cmd_list(layout: NvmeLayout) -> None:
    fingerprint, table = _load(layout)
    files = _block_files(layout)
    size = sum(p.stat().st_size for p in files)
    print(f"{layout.root}  model={fingerprint.get('model', '?')}  "
          f"{len(files)} block files, {size / 2**20:.1f} MiB")
    for ws in sorted(table, key=lambda w: -w.last_used_s):
        age_h = (time.time() - ws.last_used_s) / 3600
        print(f"  {ws.session_id!r:<40.40} tokens={ws.num_tokens:<8} blocks={len(ws.block_hashes):<6} "
              f"forks={ws.num_forks:<3} idle={age_h:.1f}h salt={ws.salt_digest[:8]}")


def cmd_delete(layout: NvmeLayout, session_id: str, cache_salt: str) -> int:
    fingerprint, table = _load(layout)
    ws = table.delete(salt_digest(cache_salt), session_id)
    if ws is None:
        return 0
    still = _listed(table)
    doomed = [p for p in _block_files(layout)
              if p.name.split(".")[0] in {h.hex() for h in ws.block_hashes} - still]
    freed = _remove(doomed)
    write_manifest(layout.manifest, table, fingerprint)
    print(f"deleted session {session_id!r}: {len(doomed)} block files, {freed / 2**20:.1f} MiB")
    return 1


def cmd_cleanup(layout: NvmeLayout, older_than_s: float | None, max_bytes: int | None) -> None:
    fingerprint, table = _load(layout)
    now = time.time()
    if older_than_s is not None:
        for ws in list(table):
            if now - ws.last_used_s > older_than_s:
                table.delete(ws.salt_digest, ws.session_id)
    still = _listed(table)
    files = _block_files(layout)
    doomed = []
    if older_than_s is not None:
        doomed = [p for p in files
                  if p.name.split(".")[0] not in still and now - p.stat().st_mtime > older_than_s]
    freed = _remove(doomed)
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
    write_manifest(layout.manifest, table, fingerprint)
    print(f"{layout.root}: removed {len(doomed)} block files ({freed / 2**20:.1f} MiB), "
          f"{len(table)} sessions kept")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="vllm-sekv sessions", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="action", required=True)
    for name in ("list", "delete", "cleanup"):
        p = sub.add_parser(name)
        p.add_argument("--nvme-dir", required=True)
        if name == "delete":
            p.add_argument("session_id")
            p.add_argument("--cache-salt", default="", help="the tenant's cache_salt, if any")
        if name == "cleanup":
            p.add_argument("--older-than", default=None, help="e.g. 12h, 7d")
            p.add_argument("--max-bytes", default=None, help="e.g. 100G")
    args = ap.parse_args(argv)
    try:
        layouts = _folders(args.nvme_dir)
        older = parse_age_s(args.older_than) if getattr(args, "older_than", None) else None
        max_bytes = (parse_size_bytes("--max-bytes", args.max_bytes)
                     if getattr(args, "max_bytes", None) else None)
        found = 0
        for layout in layouts:
            lock = DirLock(layout.lock_path).acquire()
            try:
                if args.action == "list":
                    cmd_list(layout)
                elif args.action == "delete":
                    found += cmd_delete(layout, args.session_id, args.cache_salt)
                else:
                    cmd_cleanup(layout, older, max_bytes)
            finally:
                lock.release()
        if args.action == "delete" and not found:
            print(f"no session {args.session_id!r} in {args.nvme_dir}")
            return 1
    except (ValueError, ManifestError, RuntimeError) as e:
        print(f"vllm-sekv sessions: {e}")
        return 2
    return 0
