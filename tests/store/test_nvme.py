"""The NVMe tier's records on real files: round trips, and every fault a disk can
show turning into a failed completion (a miss), never an exception or wrong KV."""
import contextlib
import os
import stat
import subprocess
import uuid

import pytest
import torch

from vllm_sekv.store import HostPool
from vllm_sekv.store.nvme import DirLock, NvmeDirInUse, NvmeLayout, RecordIO
from vllm_sekv.store.records import RecordLayout, record_bytes

H0, H1 = b"\x01" * 16, b"\x02" * 16
TENANT, OTHER_TENANT = b"\xaa" * 16, b"\xbb" * 16
MODEL = b"\x11" * 32


def make_io(root, num_slots=4, fingerprint=MODEL, sync=True, folder="fp-test"):
    pool = HostPool(num_slots, num_layers=3, block_tokens=8, kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    pool.data.copy_(torch.randn(pool.data.shape, generator=g).to(torch.bfloat16))
    layout = RecordLayout.of_pool(fingerprint, pool.data, rank=0)
    io = RecordIO(NvmeLayout(root, folder), pool.data, layout, threads=4, sync=sync)
    return pool, io


def write_and_wait(io, slot, block_hash, start=0, tenant=TENANT):
    io.submit_write(slot, block_hash, start, tenant)
    return io.drain(wait=True)


def _read_back(io, slot=2, block_hash=H0, start=0, tenant=TENANT):
    io.submit_read(block_hash, slot, start, tenant)
    (done,) = io.drain(wait=True)
    return done


@pytest.mark.parametrize("o_direct", [True, False], ids=["o_direct", "buffered"])
def test_round_trip_is_bit_identical(tmp_path, o_direct):
    pool, io = make_io(tmp_path)
    if o_direct and not io.o_direct:
        pytest.skip("this filesystem refuses O_DIRECT")
    io.o_direct = o_direct
    original = pool.data[1].clone()
    (done,) = write_and_wait(io, 1, H0, start=64)
    assert done.ok, done.reason
    path = io.layout.block_path(H0, 0)
    assert path.stat().st_size == record_bytes(original.numel() * 2) and path.stat().st_size % 4096 == 0
    pool.data[3].zero_()
    done = _read_back(io, slot=3, start=64)
    assert done.ok, done.reason
    assert torch.equal(pool.data[3].view(torch.int16), original.view(torch.int16))


def test_everything_sekv_writes_is_owner_only(tmp_path):
    os.umask(0o022)
    pool, io = make_io(tmp_path)
    write_and_wait(io, 0, H0)
    lock = DirLock(io.layout.lock_path).acquire()
    try:
        for path in (io.layout.root, io.layout.blocks, io.layout.tmp, io.layout.block_path(H0, 0).parent):
            assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
        for path in (io.layout.block_path(H0, 0), io.layout.lock_path):
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    finally:
        lock.release()


def test_surprisal_rides_in_the_header_and_a_damaged_copy_is_only_unknown(tmp_path):
    import numpy as np

    from vllm_sekv.store.records import SURPRISAL_AT

    pool, io = make_io(tmp_path)
    surprisal = np.array([np.nan, 0.5, 7.25, 1.0, 0.0, 3.5, 12.0, 2.0], dtype=np.float32)
    io.submit_write(0, H0, 0, TENANT, surprisal)
    io.submit_write(1, H1, 8, TENANT)
    assert all(d.ok for d in io.drain(wait=True))
    got = {d.block_hash: d for d in [_read_back(io, 2, H0, 0), _read_back(io, 3, H1, 8)]}
    assert got[H0].ok and np.array_equal(got[H0].surprisal, surprisal, equal_nan=True)
    assert got[H1].ok and got[H1].surprisal is None
    path = io.layout.block_path(H0, 0)
    raw = bytearray(path.read_bytes())
    raw[SURPRISAL_AT + 8 + 4] ^= 0xFF  # inside the surprisal values: metadata with a CRC of its own
    path.write_bytes(bytes(raw))
    done = _read_back(io)
    assert done.ok and done.surprisal is None  # the KV is intact; its surprisal is unknown


# ------------------------------------------------------------------ identity


@pytest.mark.parametrize("field, offset", [
    ("block hash", 12), ("tenant", 28), ("model", 44), ("start token", 76), ("layout", 84), ("rank", 108),
])
def test_a_flipped_bit_in_any_identity_field_is_a_miss(tmp_path, field, offset):
    pool, io = make_io(tmp_path)
    write_and_wait(io, 0, H0)
    path = io.layout.block_path(H0, 0)
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))
    done = _read_back(io)
    assert not done.ok, field


def test_a_record_of_another_model_is_refused(tmp_path):
    _, other = make_io(tmp_path, fingerprint=b"\x22" * 32, folder="fp-other")
    write_and_wait(other, 0, H0)
    pool, io = make_io(tmp_path)
    target = io.layout.block_path(H0, 0)
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(other.layout.block_path(H0, 0), target)  # copied into this model's folder
    done = _read_back(io)
    assert not done.ok and "another model" in done.reason


def test_a_record_of_another_tenant_or_position_is_refused(tmp_path):
    pool, io = make_io(tmp_path)
    write_and_wait(io, 0, H0, start=32)
    assert not _read_back(io, tenant=OTHER_TENANT, start=32).ok
    assert not _read_back(io, start=0).ok  # the catalog expects it elsewhere
    assert _read_back(io, start=32).ok


def test_record_of_another_block_is_refused(tmp_path):
    pool, io = make_io(tmp_path)
    write_and_wait(io, 0, H0)
    other = io.layout.block_path(H1, 0)
    other.parent.mkdir(exist_ok=True)
    os.replace(io.layout.block_path(H0, 0), other)  # a valid record under the wrong name
    done = _read_back(io, block_hash=H1)
    assert not done.ok and "another block" in done.reason


def test_flipped_payload_byte_is_a_miss(tmp_path):
    pool, io = make_io(tmp_path)
    write_and_wait(io, 0, H0)
    path = io.layout.block_path(H0, 0)
    with open(path, "r+b") as f:
        f.seek(4096 + 1234)
        b = f.read(1)
        f.seek(4096 + 1234)
        f.write(bytes([b[0] ^ 0x10]))
    done = _read_back(io)
    assert not done.ok and "checksum" in done.reason


def test_truncated_record_is_a_miss(tmp_path):
    pool, io = make_io(tmp_path)
    write_and_wait(io, 0, H0)
    path = io.layout.block_path(H0, 0)
    os.truncate(path, path.stat().st_size - 4096)
    done = _read_back(io)
    assert not done.ok and "short read" in done.reason


def test_deleted_record_is_a_miss(tmp_path):
    pool, io = make_io(tmp_path)
    write_and_wait(io, 0, H0)
    io.delete_now(H0)
    done = _read_back(io)
    assert not done.ok and "ENOENT" in done.reason


# ----------------------------------------------------------- the start-up scan


def test_scan_finds_records_and_deletes_junk_without_hanging(tmp_path):
    pool, io = make_io(tmp_path)
    write_and_wait(io, 0, H0, start=0)
    write_and_wait(io, 1, H1, start=8)
    folder = io.layout.blocks / "ff"
    folder.mkdir(exist_ok=True)
    junk = folder / ("ff" * 16 + ".r0.blk")
    junk.write_bytes(b"not a record")
    fifo = folder / ("fe" * 16 + ".r0.blk")
    os.mkfifo(fifo)  # opening it for reading would wait for a writer forever
    nested = folder / ("fd" * 16 + ".r0.blk")
    nested.mkdir()
    damaged = io.layout.block_path(H1, 0)
    found = {(r.block_hash, r.tenant, r.start_token) for r in io.layout.scan(io.record_layout)}
    assert found == {(H0, TENANT, 0), (H1, TENANT, 8)}
    assert not junk.exists() and not fifo.exists() and not nested.exists()
    raw = bytearray(damaged.read_bytes())
    raw[80] ^= 0xFF  # the start token: the header's own CRC catches it
    damaged.write_bytes(bytes(raw))
    assert {r.block_hash for r in io.layout.scan(io.record_layout)} == {H0}
    assert not damaged.exists()


def test_whatever_tmp_holds_is_cleared(tmp_path):
    pool, io = make_io(tmp_path)
    (io.layout.tmp / "a.tmp").write_bytes(b"x")
    (io.layout.tmp / "dir").mkdir()
    (io.layout.tmp / "dir" / "f").write_bytes(b"y")
    os.mkfifo(io.layout.tmp / "fifo")
    io.layout.clear_tmp()
    assert list(io.layout.tmp.iterdir()) == []


def test_folders_removed_while_running_are_made_again(tmp_path):
    import shutil

    pool, io = make_io(tmp_path)
    shutil.rmtree(io.layout.tmp)
    shutil.rmtree(io.layout.blocks)
    (done,) = write_and_wait(io, 0, H0)
    assert done.ok, done.reason
    assert _read_back(io).ok


def test_sync_on_fsyncs_each_record_and_its_folder(tmp_path, monkeypatch):
    calls = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd)))
    pool, io = make_io(tmp_path, sync=True)
    write_and_wait(io, 0, H0)
    assert len(calls) == 2  # the record before its rename, its folder after
    calls.clear()
    pool, io = make_io(tmp_path / "b", sync=False)
    write_and_wait(io, 0, H0)
    assert calls == []


# --------------------------------------------------------------- full disks


@contextlib.contextmanager
def tmpfs(path, size):
    path.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_full_disk_fails_the_write_and_leaves_no_record(tmp_path):
    with tmpfs(tmp_path / "small", "64k") as root:
        pool, io = make_io(root, num_slots=16)  # 16 records of 8 KiB: more than fits
        results = [write_and_wait(io, s, bytes([s + 1]) * 16)[0] for s in range(16)]
        failed = [r for r in results if not r.ok]
        assert failed and all("ENOSPC" in r.reason for r in failed)
        for r in failed:
            assert not io.layout.block_path(r.block_hash, 0).exists()
        assert list(io.layout.tmp.iterdir()) == []


def test_read_only_filesystem_fails_writes_but_reads_still_work(tmp_path):
    with tmpfs(tmp_path / "ro", "8m") as root:
        pool, io = make_io(root)
        write_and_wait(io, 0, H0)
        assert subprocess.run(["mount", "-o", "remount,ro", str(root)]).returncode == 0
        (done,) = write_and_wait(io, 1, H1)
        assert not done.ok and "EROFS" in done.reason
        assert _read_back(io).ok


# -------------------------------------------------------------------- lock


def test_a_second_user_of_the_folder_is_refused(tmp_path):
    layout = NvmeLayout(tmp_path, "fp-" + uuid.uuid4().hex[:8])
    layout.create()
    first = DirLock(layout.lock_path).acquire()
    code = ("from pathlib import Path; from vllm_sekv.store.nvme import DirLock; "
            f"DirLock(Path({str(layout.lock_path)!r})).acquire()")
    proc = subprocess.run([os.sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode != 0 and "in use by another" in proc.stderr and str(os.getpid()) in proc.stderr
    layout.lock_path.unlink()  # the lock is on the folder: removing the file changes nothing
    proc = subprocess.run([os.sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode != 0 and "in use by another" in proc.stderr
    first.release()
    with pytest.raises(NvmeDirInUse):
        DirLock(layout.lock_path).acquire().acquire()  # the same process twice: still refused
