"""`vllm-sekv sessions` on a real NVMe folder (records written by RecordIO)."""
import os
import time

import torch

from vllm_sekv.sessions_cli import main, parse_age_s
from vllm_sekv.store import HostPool
from vllm_sekv.store.nvme import DirLock, NvmeLayout, RecordIO
from vllm_sekv.workspace.manifest import read_manifest, write_manifest
from vllm_sekv.workspace.sessions import SessionTable


def h(i):
    return bytes([i]) * 16


def make_folder(root):
    layout = NvmeLayout(root, "fp-0123456789abcdef")
    pool = HostPool(6, 2, 8, 1, 16, torch.float16)
    io = RecordIO(layout, pool.data, rank=0, threads=2)
    for i in range(6):
        io.submit_write(i, h(i), 8 * i)
    assert all(c.ok for c in io.drain(wait=True))
    table = SessionTable()
    table.record("", "alice", [h(0), h(1), h(2)], 24)
    table.record("", "bob", [h(0), h(3)], 16)
    table.record("tenant-2", "alice", [h(4)], 8)
    write_manifest(layout.manifest, table, {"model": "m"})
    return layout


def files(layout):
    return {p.name.split(".")[0] for p in layout.blocks.glob("*/*.blk")}


def test_delete_removes_only_blocks_no_other_session_lists(tmp_path, capsys):
    layout = make_folder(tmp_path)
    assert main(["delete", "--nvme-dir", str(tmp_path), "alice"]) == 0
    assert files(layout) == {h(i).hex() for i in (0, 3, 4, 5)}  # h0 is bob's too; h5 in no session
    _, left = read_manifest(layout.manifest)
    assert {(w.session_id, len(w.block_hashes)) for w in left} == {("bob", 2), ("alice", 1)}
    assert main(["delete", "--nvme-dir", str(tmp_path), "alice", "--cache-salt", "tenant-2"]) == 0
    assert main(["delete", "--nvme-dir", str(tmp_path), "nobody"]) == 1


def test_cleanup_by_age_and_size(tmp_path):
    layout = make_folder(tmp_path)
    old = time.time() - 3 * 86400
    for p in layout.blocks.glob("*/*.blk"):
        if p.name.startswith(h(5).hex()):
            os.utime(p, (old, old))
    assert main(["cleanup", "--nvme-dir", str(tmp_path), "--older-than", "1d"]) == 0
    assert h(5).hex() not in files(layout) and len(files(layout)) == 5
    assert main(["cleanup", "--nvme-dir", str(tmp_path), "--max-bytes", "0"]) == 0
    assert files(layout) == set()


def test_commands_refuse_while_a_server_holds_the_folder(tmp_path, capsys):
    layout = make_folder(tmp_path)
    lock = DirLock(layout.lock_path).acquire()
    try:
        assert main(["list", "--nvme-dir", str(tmp_path)]) == 2
        assert "in use by another" in capsys.readouterr().out
    finally:
        lock.release()
    assert main(["list", "--nvme-dir", str(tmp_path)]) == 0
    assert "alice" in capsys.readouterr().out


def test_age_parsing():
    assert parse_age_s("7d") == 7 * 86400 and parse_age_s("30m") == 1800
