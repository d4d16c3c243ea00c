"""The NVMe tier: one self-describing, checksummed file per block record.

Layout under `nvme_dir` (one subfolder per model fingerprint, so several models
can share a directory and a block is never read back by the wrong model):

    <nvme_dir>/secret                         the server secret (`workspace.tenants`)
    <nvme_dir>/<fingerprint>/LOCK             who holds the folder (its pid)
    <nvme_dir>/<fingerprint>/manifest.sqlite  sessions (`workspace.manifest`)
    <nvme_dir>/<fingerprint>/blocks/ab/<hash>.r<rank>.blk
    <nvme_dir>/<fingerprint>/tmp/             writes in progress

Everything sekv creates there is owner-only (folders 0700, files 0600). The
folder itself is flock-ed by the one server or command using it (a lock on the
folder, not on a file someone could unlink). A record's format is in
`store.records`. File names come from content hashes only; client-supplied
names never become paths.

A write goes to tmp/ and is renamed into blocks/ when complete. Durability is
the config's promise (`nvme_sync`): with it on, a record is fsync-ed before
its rename and its directory after, so a record that a server reported
written survives a power loss; with it off, a crash can leave empty or
partial records, which the checksum catches (a miss) and the start-up scan
deletes. Folders removed while a server runs are made again.

`RecordIO` runs in the worker process. Its reads and writes run on a thread
pool (the system calls and the checksums release the GIL), with O_DIRECT where
the filesystem allows it (not on tmpfs) and buffered I/O elsewhere. It never
raises into the forward pass: every failure (missing file, short read, bad
header, checksum mismatch, wrong identity, I/O error, full disk, read-only
directory) comes back as a failed completion with a reason, and the caller
treats the block as a miss.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import shutil
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from vllm_sekv.store.io_jobs import IoJobs
from vllm_sekv.store.records import (
    CODEC_FP8, HEADER_BYTES, RecordError, RecordLayout, checksum_kind, pack_header, record_bytes, unpack_header,
    unpack_surprisal, verify,
)

logger = logging.getLogger("vllm_sekv")

ALIGN_BYTES = 4096
MANIFEST_NAME = "manifest.sqlite"


def folder_name(fingerprint: dict) -> str:
    """The subfolder of `nvme_dir` for one model fingerprint."""
    from vllm_sekv.store.records import fingerprint_digest

    return "fp-" + fingerprint_digest(fingerprint).hex()[:16]


class NvmeDirInUse(RuntimeError):
    pass


@dataclass(frozen=True)
class RecordInfo:
    block_hash: bytes
    tenant: bytes
    start_token: int
    rank: int
    path: Path


def _mkdir(path: Path) -> None:
    """`path` and its missing parents, owner-only (an existing one made so)."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.stat().st_mode & 0o077:
        os.chmod(path, 0o700)


class NvmeLayout:
    """Paths of one fingerprint's folder. Creating it never deletes anything."""

    def __init__(self, nvme_dir: str | Path, fingerprint: str) -> None:
        self.root = Path(nvme_dir) / fingerprint
        self.blocks = self.root / "blocks"
        self.tmp = self.root / "tmp"
        self.manifest = self.root / MANIFEST_NAME
        self.lock_path = self.root / "LOCK"

    def create(self) -> None:
        for d in (self.root, self.blocks, self.tmp):
            _mkdir(d)

    def block_path(self, block_hash: bytes, rank: int) -> Path:
        h = block_hash.hex()
        return self.blocks / h[:2] / f"{h}.r{rank}.blk"

    def scan(self, layout: RecordLayout) -> list[RecordInfo]:
        """Records of `layout.rank` found on disk, oldest first (modification
        time). A file that is not a regular file, or whose header is damaged,
        from another model or layout, or does not match its name, is deleted
        (it could only ever be a miss), with a log line."""
        out = []
        for path in self.blocks.glob(f"*/*.r{layout.rank}.blk"):
            try:
                info = os.lstat(path)
                if not stat.S_ISREG(info.st_mode):
                    raise RecordError("not a regular file")
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
                try:
                    raw = os.pread(fd, HEADER_BYTES, 0)
                finally:
                    os.close(fd)
                header = unpack_header(raw, layout)
                if header.block_hash.hex() != path.name.split(".")[0]:
                    raise RecordError("header does not match the file name")
            except (OSError, RecordError) as e:
                logger.warning("sekv nvme: deleting %s: %s", path, e)
                _remove(path)
                continue
            out.append(RecordInfo(header.block_hash, header.tenant, header.start_token, layout.rank, path))
        return sorted(out, key=lambda r: _mtime(r.path))

    def clear_tmp(self) -> None:
        """Remove whatever an earlier run left in tmp/ (files, folders, anything)."""
        for path in self.tmp.iterdir():
            _remove(path)


def _remove(path: Path) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    except OSError as e:
        logger.warning("sekv nvme: could not remove %s: %s", path, e)


class DirLock:
    """An exclusive, non-blocking flock on a folder, held until `release` or
    process exit; the holder's pid goes into `<folder>/LOCK` for the message
    a second server or command gets (it fails fast)."""

    def __init__(self, lock_path: Path) -> None:
        self.path = lock_path
        self._fd: int | None = None

    def acquire(self) -> "DirLock":
        fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise NvmeDirInUse(
                    f"sekv config 'nvme_dir': {self.path.parent} is in use by another "
                    f"sekv server or command (pid {self._holder()}); give each server its own nvme_dir"
                ) from None
            raise
        self._fd = fd
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}")
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(str(os.getpid()))
        os.replace(tmp, self.path)
        return self

    def _holder(self) -> str:
        try:
            return self.path.read_text()[:32].strip() or "unknown"
        except OSError:
            return "unknown"

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def supports_o_direct(folder: Path) -> bool:
    probe = folder / f".odirect-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        buf = mmap.mmap(-1, ALIGN_BYTES)
        os.write(fd, buf)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


@dataclass
class Completion:
    kind: str  # "write" | "read"
    block_hash: bytes
    ok: bool
    host_slot: int = -1
    start_token: int = 0
    reason: str = ""
    surprisal: np.ndarray | None = None  # a read's per-token surprisal, if its record has it


class RecordIO:
    """Asynchronous record reads and writes against one host pool (worker side).

    `submit_*` return at once; `drain()` returns the completions finished so far.
    A slot handed to `submit_write` must not change until its completion is
    drained. A slot handed to `submit_read` is written by an I/O thread and
    holds the block only once its completion is drained as ok; after a failed
    read its contents are undefined (the caller never uses it).

    When the pool's slots are page-aligned and a whole number of pages (the
    common case), payloads move between the file and the slot with one vectored
    system call and no copy; otherwise through a per-thread bounce buffer.
    Checksums are XXH3-64 when the `xxhash` package is present, else CRC32; the
    kind is recorded in each header, so either reader checks either record.
    """

    def __init__(self, layout: NvmeLayout, pool_data: torch.Tensor, record_layout: RecordLayout, threads: int,
                 sync: bool = True, pool_scales: torch.Tensor | None = None) -> None:
        self.layout = layout
        self.pool = pool_data
        self.scales = pool_scales  # an fp8 pool's scales: after the slot's bytes in the payload
        if (pool_scales is not None) != (record_layout.codec == CODEC_FP8):
            raise ValueError("an fp8 record layout goes with an fp8 pool's scales, and only with them")
        self.record_layout = record_layout
        self.rank = record_layout.rank
        self.payload_bytes = record_layout.payload_bytes
        self.record_bytes = record_bytes(self.payload_bytes)
        self.checksum_kind = checksum_kind()
        self.sync = sync
        layout.create()
        self.o_direct = supports_o_direct(layout.tmp)
        self._zero_copy = (
            self.payload_bytes % ALIGN_BYTES == 0
            and pool_scales is None
            and pool_data.data_ptr() % ALIGN_BYTES == 0
            and pool_data.is_contiguous()
        )
        self._local = threading.local()
        self._jobs = IoJobs(threads, "sekv-nvme")
        logger.info("sekv nvme: %s, %s I/O%s, %d threads, %s", layout.root,
                    "O_DIRECT" if self.o_direct else "buffered",
                    ", zero-copy" if self._zero_copy else "", threads,
                    "fsync before and after each rename" if sync else "no fsync")

    # ------------------------------------------------------------- public

    def submit_write(self, host_slot: int, block_hash: bytes, start_token: int, tenant: bytes,
                     surprisal: np.ndarray | None = None) -> None:
        """`surprisal` ([block_tokens] float32, optional) is stored in the header."""
        self._jobs.submit(lambda: [self._write(host_slot, block_hash, start_token, tenant, surprisal)])

    def submit_read(self, block_hash: bytes, host_slot: int, start_token: int, tenant: bytes) -> None:
        self._jobs.submit(lambda: [self._read(block_hash, host_slot, start_token, tenant)])

    def delete_now(self, block_hash: bytes) -> None:
        """Remove a record's file (blocking; cheap). Runs before any later
        write of the same block, so the two cannot race."""
        try:
            self.layout.block_path(block_hash, self.rank).unlink(missing_ok=True)
        except OSError as e:
            logger.warning("sekv nvme: could not delete %s: %s", block_hash.hex(), _reason(e))

    def drain(self, wait: bool = False) -> list[Completion]:
        """The reads and writes finished so far (with `wait`: all of them)."""
        return self._jobs.drain(wait)

    def close(self) -> None:
        self._jobs.close()

    # ----------------------------------------------------------- the I/O

    def _slot_bytes(self, host_slot: int) -> memoryview:
        return memoryview(self.pool[host_slot].view(torch.uint8).reshape(-1).numpy())

    def _scale_bytes(self, host_slot: int) -> memoryview:
        return memoryview(self.scales[host_slot].view(torch.uint8).reshape(-1).numpy())

    def _payload(self, host_slot: int) -> memoryview:
        """The record's payload of a slot: its bytes (no copy), then an fp8 pool's scales (one copy)."""
        if self.scales is None:
            return self._slot_bytes(host_slot)
        return memoryview(bytes(self._slot_bytes(host_slot)) + bytes(self._scale_bytes(host_slot)))

    def _buffers(self) -> tuple[mmap.mmap, mmap.mmap | None]:
        """This thread's page-aligned header buffer and (if needed) bounce buffer."""
        local = self._local
        if not hasattr(local, "header"):
            local.header = mmap.mmap(-1, HEADER_BYTES)
            local.bounce = None if self._zero_copy else mmap.mmap(-1, self.record_bytes - HEADER_BYTES)
        return local.header, local.bounce

    def _open(self, path: Path, flags: int) -> int:
        return os.open(path, flags | (os.O_DIRECT if self.o_direct else 0), 0o600)

    def _write(self, host_slot: int, block_hash: bytes, start_token: int, tenant: bytes,
               surprisal: np.ndarray | None = None) -> Completion:
        tmp = self.layout.tmp / f"{block_hash.hex()}.r{self.rank}.{os.getpid()}.tmp"
        final = self.layout.block_path(block_hash, self.rank)
        try:
            payload = self._payload(host_slot)
            header, bounce = self._buffers()
            header[:] = pack_header(block_hash, tenant, start_token, self.record_layout, payload,
                                    self.checksum_kind, surprisal)
            if bounce is not None:
                bounce[: self.payload_bytes] = payload
                body = bounce
            else:
                body = payload
            try:
                fd = self._open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            except FileNotFoundError:  # tmp/ was removed while we ran: make it again
                self.layout.create()
                fd = self._open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:
                _write_all(fd, [memoryview(header), memoryview(body)[: self.record_bytes - HEADER_BYTES]])
                if self.sync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            _mkdir(final.parent)
            os.replace(tmp, final)
            if self.sync:
                _fsync_dir(final.parent)
            return Completion("write", block_hash, True, host_slot, start_token)
        except OSError as e:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            return Completion("write", block_hash, False, host_slot, start_token, _reason(e))

    def _read(self, block_hash: bytes, host_slot: int, start_token: int, tenant: bytes) -> Completion:
        path = self.layout.block_path(block_hash, self.rank)
        try:
            header, bounce = self._buffers()
            slot = self._slot_bytes(host_slot)
            fd = self._open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise RecordError("not a regular file")
                got = os.preadv(fd, [header, bounce if bounce is not None else slot], 0)
            finally:
                os.close(fd)
            if got != self.record_bytes:
                raise RecordError(f"short read ({got} of {self.record_bytes} bytes)")
            head = unpack_header(header, self.record_layout)
            if (head.block_hash, head.tenant, head.start_token) != (block_hash, tenant, start_token):
                raise RecordError("the record is another block's")
            if self.scales is not None:
                body = memoryview(bounce)[: self.payload_bytes]
                verify(head, body)
                slot[:] = body[: len(slot)]
                self._scale_bytes(host_slot)[:] = body[len(slot):]
                return Completion("read", block_hash, True, host_slot, start_token,
                                  surprisal=unpack_surprisal(header))
            if bounce is not None:
                slot[:] = memoryview(bounce)[: self.payload_bytes]
            verify(head, slot)
            return Completion("read", block_hash, True, host_slot, start_token, surprisal=unpack_surprisal(header))
        except (OSError, RecordError, ImportError) as e:
            return Completion("read", block_hash, False, host_slot, start_token, _reason(e))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, views: list[memoryview]) -> None:
    """Write all of `views` at offset 0; a short write is continued, so that a
    full disk surfaces as the system's own error (ENOSPC) rather than a count."""
    done = 0
    while views:
        n = os.pwritev(fd, views, done)
        if n <= 0:
            raise OSError(errno.EIO, f"write made no progress at byte {done}")
        done += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views = views[1:]
        if views and n:
            views = [views[0][n:], *views[1:]]


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _reason(e: Exception) -> str:
    if isinstance(e, OSError) and e.errno is not None:
        return f"{errno.errorcode.get(e.errno, e.errno)}: {e.strerror or e}"
    return str(e)
