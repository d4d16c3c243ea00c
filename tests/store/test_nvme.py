"""The NVMe tier's records on real files: round trips, and every fault a disk can
show turning into a failed completion (a miss), never an exception or wrong KV."""
import contextlib
import os
import subprocess
import uuid

import pytest
import torch

from vllm_sekv.store import HostPool
from vllm_sekv.store.nvme import DirLock, NvmeDirInUse, NvmeLayout, RecordIO, record_bytes

H0, H1 = b"\x01" * 16, b"\x02" * 16


def make_io(root, num_slots=4):
    pool = HostPool(num_slots, num_layers=3, block_tokens=8, kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    pool.data.copy_(torch.randn(pool.data.shape, generator=g).to(torch.bfloat16))
    io = RecordIO(NvmeLayout(root, "fp-test"), pool.data, rank=0, threads=4)
    return pool, io


def write_and_wait(io, slot, block_hash, start=0):
    io.submit_write(slot, block_hash, start)
    return io.drain(wait=True)


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
    io.submit_read(H0, 3, 64)
    (done,) = io.drain(wait=True)
    assert done.ok, done.reason
    assert torch.equal(pool.data[3].view(torch.int16), original.view(torch.int16))


def test_surprisal_rides_in_the_header_and_a_damaged_copy_is_only_unknown(tmp_path):
    import numpy as np

    pool, io = make_io(tmp_path)
    surprisal = np.array([np.nan, 0.5, 7.25, 1.0, 0.0, 3.5, 12.0, 2.0], dtype=np.float32)
    io.submit_write(0, H0, 0, surprisal)
    io.submit_write(1, H1, 8)  # no surprisal: as records written before it existed
    assert all(d.ok for d in io.drain(wait=True))
    io.submit_read(H0, 2, 0)
    io.submit_read(H1, 3, 8)
    got = {d.block_hash: d for d in io.drain(wait=True)}
    assert got[H0].ok and np.array_equal(got[H0].surprisal, surprisal, equal_nan=True)
    assert got[H1].ok and got[H1].surprisal is None
    path = io.layout.block_path(H0, 0)
    raw = bytearray(path.read_bytes())
    raw[80] ^= 0xFF  # inside the surprisal values (header bytes 68..99), outside the checked payload
    path.write_bytes(bytes(raw))
    io.submit_read(H0, 2, 0)
    (done,) = io.drain(wait=True)
    assert done.ok and done.surprisal is None  # the KV is intact; its surprisal is unknown


def test_scan_finds_records_and_skips_junk(tmp_path):
    pool, io = make_io(tmp_path)
    write_and_wait(io, 0, H0, start=0)
    write_and_wait(io, 1, H1, start=8)
    junk = io.layout.blocks / "ff" / ("ff" * 16 + ".r0.blk")
    junk.parent.mkdir(exist_ok=True)
    junk.write_bytes(b"not a record")
    found = {(r.block_hash, r.start_token) for r in io.layout.scan(rank=0)}
    assert found == {(H0, 0), (H1, 8)}


def _read_back(io, slot=2, block_hash=H0, start=0):
    io.submit_read(block_hash, slot, start)
    (done,) = io.drain(wait=True)
    return done


def test_truncated_record_is_a_miss(tmp_path):
    pool, io = make_io(tmp_path)
    write_and_wait(io, 0, H0)
    path = io.layout.block_path(H0, 0)
    os.truncate(path, path.stat().st_size - 4096)
    done = _read_back(io)
    assert not done.ok and "short read" in done.reason


def test_flipped_byte_is_a_miss(tmp_path):
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


def test_record_of_another_block_is_refused(tmp_path):
    pool, io = make_io(tmp_path)
    write_and_wait(io, 0, H0)
    other = io.layout.block_path(H1, 0)
    other.parent.mkdir(exist_ok=True)
    os.replace(io.layout.block_path(H0, 0), other)  # a valid record under the wrong name
    done = _read_back(io, block_hash=H1)
    assert not done.ok and "header" in done.reason


def test_deleted_record_is_a_miss(tmp_path):
    pool, io = make_io(tmp_path)
    write_and_wait(io, 0, H0)
    io.delete_now(H0)
    done = _read_back(io)
    assert not done.ok and "ENOENT" in done.reason


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


def test_a_second_user_of_the_folder_is_refused(tmp_path):
    layout = NvmeLayout(tmp_path, "fp-" + uuid.uuid4().hex[:8])
    layout.create()
    first = DirLock(layout.lock_path).acquire()
    code = ("from pathlib import Path; from vllm_sekv.store.nvme import DirLock; "
            f"DirLock(Path({str(layout.lock_path)!r})).acquire()")
    proc = subprocess.run([os.sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode != 0 and "in use by another" in proc.stderr and str(os.getpid()) in proc.stderr
    first.release()
    with pytest.raises(NvmeDirInUse):
        DirLock(layout.lock_path).acquire().acquire()  # the same process twice: still refused
