"""`vllm-sekv sessions` on a real NVMe folder (records written by RecordIO,
sessions in the folder's manifest, tenants keyed by the folder's secret)."""
import os
import time

import torch

from vllm_sekv.cli import main as cli_main
from vllm_sekv.cli.nvme_sessions import parse_age_s
from vllm_sekv.store import HostPool
from vllm_sekv.store.nvme import DirLock, NvmeLayout, RecordIO
from vllm_sekv.store.records import RecordLayout
from vllm_sekv.workspace.manifest import Manifest
from vllm_sekv.workspace.sessions import SessionTable
from vllm_sekv.workspace.tenants import TenantKeys, resolve_secret, tenant_bytes


def main(argv):
    return cli_main(["sessions", *argv])


def h(i):
    return bytes([i]) * 16


def make_folder(root):
    """Blocks 0-5 of the tenant without a salt, 6-7 of tenant "tenant-2";
    alice's earlier history held h(5), which she forked away from."""
    keys = TenantKeys(resolve_secret("", root))
    a, b = keys.of(""), keys.of("tenant-2")
    layout = NvmeLayout(root, "fp-0123456789abcdef")
    pool = HostPool(8, 2, 8, 1, 16, torch.float16)
    io = RecordIO(layout, pool.data, RecordLayout.of_pool(b"\x00" * 32, pool.data, 0), threads=2)
    for i in range(8):
        io.submit_write(i, h(i), 8 * i, tenant_bytes(a if i < 6 else b))
    assert all(c.ok for c in io.drain(wait=True))
    table = SessionTable()
    table.record(a, "alice", [h(0), h(1), h(5)], 24)
    table.record(a, "alice", [h(0), h(1), h(2)], 24)  # forked away from h(5)
    table.record(a, "bob", [h(0), h(3)], 16)
    table.record(b, "alice", [h(6)], 8)
    manifest = Manifest(layout.manifest, {"model": "m"})
    manifest.put(table)
    manifest.close()
    return layout, a, b


def files(layout):
    return {p.name.split(".")[0] for p in layout.blocks.glob("*/*.blk")}


def sessions(layout):
    manifest = Manifest(layout.manifest, {})
    try:
        return {(w.tenant, w.session_id, len(w.block_hashes)) for w in manifest.load()}
    finally:
        manifest.close()


def test_delete_removes_the_session_and_its_forks_but_no_block_another_session_lists(tmp_path):
    layout, a, b = make_folder(tmp_path)
    assert main(["delete", "--nvme-dir", str(tmp_path), "alice"]) == 0
    # h0 is bob's too; h4 belongs to no session; h5 was alice's before her fork
    assert files(layout) == {h(i).hex() for i in (0, 3, 4, 6, 7)}
    assert sessions(layout) == {(a, "bob", 2), (b, "alice", 1)}
    assert main(["delete", "--nvme-dir", str(tmp_path), "nobody"]) == 1


def test_delete_all_of_a_tenant_removes_its_unnamed_blocks_too(tmp_path):
    layout, a, b = make_folder(tmp_path)
    assert main(["delete", "--nvme-dir", str(tmp_path), "--all-of-tenant", "--cache-salt", "tenant-2"]) == 0
    assert files(layout) == {h(i).hex() for i in range(6)}  # 6 (named) and 7 (unnamed) are gone
    assert sessions(layout) == {(a, "alice", 3), (a, "bob", 2)}
    assert main(["delete", "--nvme-dir", str(tmp_path), "--all-of-tenant"]) == 0
    assert files(layout) == set() and sessions(layout) == set()


def test_cleanup_by_age_and_size(tmp_path):
    layout, _, _ = make_folder(tmp_path)
    old = time.time() - 3 * 86400
    for p in layout.blocks.glob("*/*.blk"):
        if p.name.startswith(h(4).hex()):
            os.utime(p, (old, old))
    assert main(["cleanup", "--nvme-dir", str(tmp_path), "--older-than", "1d"]) == 0
    assert h(4).hex() not in files(layout) and len(files(layout)) == 7
    assert main(["cleanup", "--nvme-dir", str(tmp_path), "--max-bytes", "0"]) == 0
    assert files(layout) == set()


def test_commands_refuse_while_a_server_holds_the_folder(tmp_path, capsys):
    layout, _, _ = make_folder(tmp_path)
    lock = DirLock(layout.lock_path).acquire()
    try:
        assert main(["list", "--nvme-dir", str(tmp_path)]) == 2
        assert "in use by another" in capsys.readouterr().err
    finally:
        lock.release()
    assert main(["list", "--nvme-dir", str(tmp_path)]) == 0
    assert "alice" in capsys.readouterr().out


def test_age_parsing():
    assert parse_age_s("7d") == 7 * 86400 and parse_age_s("30m") == 1800


def test_delete_needs_a_session_or_the_whole_tenant(tmp_path, capsys):
    make_folder(tmp_path)
    assert main(["delete", "--nvme-dir", str(tmp_path)]) == 2
    assert main(["delete", "--nvme-dir", str(tmp_path), "alice", "--all-of-tenant"]) == 2
    assert "SESSION_ID or --all-of-tenant" in capsys.readouterr().err
