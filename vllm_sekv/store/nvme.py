"""The NVMe tier: one self-describing, checksummed file per block record.

Layout under `nvme_dir` (one subfolder per model fingerprint, so several models
can share a directory and a block is never read back by the wrong model):

    <nvme_dir>/<fingerprint>/LOCK             flock-ed by the one server using it
    <nvme_dir>/<fingerprint>/manifest.json    sessions (see workspace/manifest.py)
    <nvme_dir>/<fingerprint>/blocks/ab/<hash>.r<rank>.blk
    <nvme_dir>/<fingerprint>/tmp/             writes in progress

A record is a 4 KiB header followed by the block's bytes (the host pool's slot
layout), padded to 4 KiB. The header may also carry the block's per-token
surprisal (SeKV; float32, with its own CRC32): metadata, so a damaged copy
only makes it unknown, never fails the read. File names come from content hashes only (which cover
the tenant's salt); client-supplied names never become paths. A write goes to
tmp/ and is renamed into blocks/ when complete, so a crash leaves no record
under blocks/ that was not written whole; the payload's checksum, checked on
every read, catches the rest (torn pages, bit rot, tampering).

`RecordIO` runs in the worker process. Its reads and writes run on a thread
pool (the system calls and the checksums release the GIL), with O_DIRECT where
the filesystem allows it (not on tmpfs) and buffered I/O elsewhere. It never
raises into the forward pass: every failure (missing file, short read, bad
header, checksum mismatch, I/O error, full disk, read-only directory) comes
back as a failed completion with a reason, and the caller treats the block as
a miss.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import mmap
import os
import struct
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger("vllm_sekv")

MAGIC = b"SEKVBLK1"
FORMAT_VERSION = 1
HEADER_BYTES = 4096
ALIGN_BYTES = 4096
# magic, version, block hash, start token, payload bytes, checksum kind,
# checksum of the payload, rank
_HEADER = struct.Struct("<8sI16sqqIQi")
CHECKSUM_CRC32, CHECKSUM_XXH3 = 1, 2
# After the header struct: surprisal count (0: none), CRC32 of the values, then
# float32 x count. Records written before it have zeros there: no surprisal.
_SURPRISAL = struct.Struct("<II")
MAX_SURPRISAL_TOKENS = (HEADER_BYTES - _HEADER.size - _SURPRISAL.size) // 4


def _checksum_fn(kind: int):
    if kind == CHECKSUM_XXH3:
        import xxhash

        return xxhash.xxh3_64_intdigest
    if kind == CHECKSUM_CRC32:
        return zlib.crc32
    raise ValueError(f"unknown checksum kind {kind}")


def _best_checksum() -> int:
    try:
        _checksum_fn(CHECKSUM_XXH3)
        return CHECKSUM_XXH3
    except ImportError:
        return CHECKSUM_CRC32


def record_bytes(payload_bytes: int) -> int:
    return HEADER_BYTES + -(-payload_bytes // ALIGN_BYTES) * ALIGN_BYTES


def folder_name(fingerprint: dict) -> str:
    """The subfolder of `nvme_dir` for one model fingerprint."""
    digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()
    return "fp-" + digest[:16]


class NvmeDirInUse(RuntimeError):
    pass


@dataclass(frozen=True)
class RecordInfo:
    block_hash: bytes
    start_token: int
    rank: int
    path: Path


class NvmeLayout:
    """Paths of one fingerprint's folder. Creating it never deletes anything."""

    def __init__(self, nvme_dir: str | Path, fingerprint: str) -> None:
        self.root = Path(nvme_dir) / fingerprint
        self.blocks = self.root / "blocks"
        self.tmp = self.root / "tmp"
        self.manifest = self.root / "manifest.json"
        self.lock_path = self.root / "LOCK"

    def create(self) -> None:
        for d in (self.blocks, self.tmp):
            d.mkdir(parents=True, exist_ok=True)

    def block_path(self, block_hash: bytes, rank: int) -> Path:
        h = block_hash.hex()
        return self.blocks / h[:2] / f"{h}.r{rank}.blk"

    def scan(self, rank: int = 0) -> list[RecordInfo]:
        """Records of `rank` found on disk, oldest first (file modification
        time). Unreadable headers are skipped and logged: they would be misses."""
        out = []
        for path in self.blocks.glob(f"*/*.r{rank}.blk"):
            try:
                with open(path, "rb") as f:
                    raw = f.read(_HEADER.size)
                magic, version, block_hash, start, _, _, _, r = _HEADER.unpack(raw)
                if magic != MAGIC or version != FORMAT_VERSION or r != rank:
                    raise ValueError("bad header")
                if block_hash.hex() != path.name.split(".")[0]:
                    raise ValueError("header does not match the file name")
            except (OSError, ValueError, struct.error) as e:
                logger.warning("sekv nvme: ignoring %s: %s", path, e)
                continue
            out.append(RecordInfo(block_hash, start, rank, path))
        return sorted(out, key=lambda r: _mtime(r.path))

    def clear_tmp(self) -> None:
        for path in self.tmp.glob("*"):
            path.unlink(missing_ok=True)


class DirLock:
    """An exclusive, non-blocking flock on `<folder>/LOCK`, held until `release`
    or process exit. A second server on the same folder fails fast."""

    def __init__(self, lock_path: Path) -> None:
        self.path = lock_path
        self._fd: int | None = None

    def acquire(self) -> "DirLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise NvmeDirInUse(
                    f"sekv config 'nvme_dir': {self.path.parent} is in use by another "
                    f"sekv server or command (pid {holder}); give each server its own nvme_dir"
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def supports_o_direct(folder: Path) -> bool:
    probe = folder / f".odirect-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
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

    def __init__(self, layout: NvmeLayout, pool_data: torch.Tensor, rank: int, threads: int) -> None:
        self.layout = layout
        self.pool = pool_data
        self.rank = rank
        self.payload_bytes = pool_data[0].numel() * pool_data.element_size()
        self.record_bytes = record_bytes(self.payload_bytes)
        self.checksum_kind = _best_checksum()
        layout.create()
        self.o_direct = supports_o_direct(layout.tmp)
        self._zero_copy = (
            self.payload_bytes % ALIGN_BYTES == 0
            and pool_data.data_ptr() % ALIGN_BYTES == 0
            and pool_data.is_contiguous()
        )
        self._local = threading.local()
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="sekv-nvme")
        self._futures: list[Future] = []
        logger.info("sekv nvme: %s, %s I/O%s, %d threads", layout.root,
                    "O_DIRECT" if self.o_direct else "buffered",
                    ", zero-copy" if self._zero_copy else "", threads)

    # ------------------------------------------------------------- public

    def submit_write(self, host_slot: int, block_hash: bytes, start_token: int,
                     surprisal: np.ndarray | None = None) -> None:
        """`surprisal` ([block_tokens] float32, optional) is stored in the header."""
        self._futures.append(self._executor.submit(self._write, host_slot, block_hash, start_token, surprisal))

    def submit_read(self, block_hash: bytes, host_slot: int, start_token: int) -> None:
        self._futures.append(self._executor.submit(self._read, block_hash, host_slot, start_token))

    def delete_now(self, block_hash: bytes) -> None:
        """Remove a record's file (blocking; cheap). Runs before any later
        write of the same block, so the two cannot race."""
        try:
            self.layout.block_path(block_hash, self.rank).unlink(missing_ok=True)
        except OSError as e:
            logger.warning("sekv nvme: could not delete %s: %s", block_hash.hex(), _reason(e))

    def drain(self, wait: bool = False) -> list[Completion]:
        done, pending = [], []
        for fut in self._futures:
            if wait or fut.done():
                done.append(fut.result())
            else:
                pending.append(fut)
        self._futures = pending
        return done

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    # ----------------------------------------------------------- the I/O

    def _slot_bytes(self, host_slot: int) -> memoryview:
        return memoryview(self.pool[host_slot].view(torch.uint8).reshape(-1).numpy())

    def _buffers(self) -> tuple[mmap.mmap, mmap.mmap | None]:
        """This thread's page-aligned header buffer and (if needed) bounce buffer."""
        local = self._local
        if not hasattr(local, "header"):
            local.header = mmap.mmap(-1, HEADER_BYTES)
            local.bounce = None if self._zero_copy else mmap.mmap(-1, self.record_bytes - HEADER_BYTES)
        return local.header, local.bounce

    def _open(self, path: Path, flags: int) -> int:
        return os.open(path, flags | (os.O_DIRECT if self.o_direct else 0), 0o644)

    def _write(self, host_slot: int, block_hash: bytes, start_token: int,
               surprisal: np.ndarray | None = None) -> Completion:
        tmp = self.layout.tmp / f"{block_hash.hex()}.r{self.rank}.{os.getpid()}.tmp"
        final = self.layout.block_path(block_hash, self.rank)
        try:
            payload = self._slot_bytes(host_slot)
            header, bounce = self._buffers()
            checksum = _checksum_fn(self.checksum_kind)(payload)
            header[:] = (_HEADER.pack(MAGIC, FORMAT_VERSION, block_hash, start_token, self.payload_bytes,
                                      self.checksum_kind, checksum, self.rank)
                         + _pack_surprisal(surprisal)).ljust(HEADER_BYTES, b"\0")
            if bounce is not None:
                bounce[: self.payload_bytes] = payload
                body = bounce
            else:
                body = payload
            fd = self._open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:
                _write_all(fd, [memoryview(header), memoryview(body)[: self.record_bytes - HEADER_BYTES]])
            finally:
                os.close(fd)
            final.parent.mkdir(exist_ok=True)
            os.replace(tmp, final)
            return Completion("write", block_hash, True, host_slot, start_token)
        except OSError as e:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            return Completion("write", block_hash, False, host_slot, start_token, _reason(e))

    def _read(self, block_hash: bytes, host_slot: int, start_token: int) -> Completion:
        path = self.layout.block_path(block_hash, self.rank)
        try:
            header, bounce = self._buffers()
            slot = self._slot_bytes(host_slot)
            fd = self._open(path, os.O_RDONLY)
            try:
                got = os.preadv(fd, [header, bounce if bounce is not None else slot], 0)
            finally:
                os.close(fd)
            if got != self.record_bytes:
                raise ValueError(f"short read ({got} of {self.record_bytes} bytes)")
            magic, version, h, start, size, kind, checksum, rank = _HEADER.unpack_from(header, 0)
            if (magic, version, h, start, size, rank) != (
                MAGIC, FORMAT_VERSION, block_hash, start_token, self.payload_bytes, self.rank
            ):
                raise ValueError("header does not match the record asked for")
            if bounce is not None:
                slot[:] = memoryview(bounce)[:size]
            if _checksum_fn(kind)(slot) != checksum:
                raise ValueError("checksum mismatch")
            return Completion("read", block_hash, True, host_slot, start_token,
                              surprisal=_unpack_surprisal(header))
        except (OSError, ValueError, ImportError, struct.error) as e:
            return Completion("read", block_hash, False, host_slot, start_token, _reason(e))


def _pack_surprisal(surprisal: np.ndarray | None) -> bytes:
    if surprisal is None or not len(surprisal):
        return _SURPRISAL.pack(0, 0)
    values = np.ascontiguousarray(surprisal, dtype=np.float32)[:MAX_SURPRISAL_TOKENS].tobytes()
    return _SURPRISAL.pack(len(values) // 4, zlib.crc32(values)) + values


def _unpack_surprisal(header: mmap.mmap) -> np.ndarray | None:
    """The header's surprisal, or None (absent, or its CRC does not match)."""
    count, crc = _SURPRISAL.unpack_from(header, _HEADER.size)
    if not 0 < count <= MAX_SURPRISAL_TOKENS:
        return None
    start = _HEADER.size + _SURPRISAL.size
    values = bytes(header[start : start + 4 * count])
    if zlib.crc32(values) != crc:
        return None
    return np.frombuffer(values, dtype=np.float32).copy()


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
