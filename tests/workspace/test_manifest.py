"""The manifest in SQLite: sessions round-trip, are written behind on a
thread of their own, and a damaged or foreign file never stops a start: it
is set aside (the blocks stay restorable by content)."""
import os
import sqlite3
import stat

import pytest

from vllm_sekv.workspace.manifest import Manifest, ManifestError, ManifestWriter, open_or_set_aside
from vllm_sekv.workspace.sessions import SessionTable, Workspace


def h(i):
    return bytes([i]) * 16


def table():
    t = SessionTable()
    t.record("a", "s1", [h(1), h(2)], 16)
    t.record("a", "s1", [h(1), h(3)], 16)  # a fork: h(2) is remembered
    t.record("b", "s1", [h(4)], 8)
    return t


def loaded(path):
    m = Manifest(path, {})
    try:
        return {(w.tenant, w.session_id): w for w in m.load()}
    finally:
        m.close()


def test_sessions_round_trip_with_their_forks_and_the_file_is_owner_only(tmp_path):
    path = tmp_path / "manifest.sqlite"
    os.umask(0o022)
    m = Manifest(path, {"model": "m"})
    m.put(table())
    m.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    got = loaded(path)
    assert got[("a", "s1")].block_hashes == [h(1), h(3)] and got[("a", "s1")].forked == {h(2)}
    assert got[("a", "s1")].num_forks == 1 and got[("b", "s1")].block_hashes == [h(4)]
    assert Manifest(path, {}).fingerprint == {"model": "m"}


def test_the_writer_thread_coalesces_and_never_loses_a_change(tmp_path):
    path = tmp_path / "manifest.sqlite"
    writer = ManifestWriter(Manifest(path, {}))
    t = SessionTable()
    for n in range(50):  # one session, many finished requests: the last state counts
        writer.put(t.record("a", "s", [h(i) for i in range(n + 1)], n))
    writer.put(t.record("a", "gone", [h(9)], 8))
    writer.delete(("a", "gone"))
    writer.close()
    got = loaded(path)
    assert set(got) == {("a", "s")} and len(got[("a", "s")].block_hashes) == 50


@pytest.mark.parametrize("damage", ["random", "truncated", "json", "version", "wrong tables"])
def test_a_damaged_or_foreign_manifest_is_set_aside(tmp_path, damage):
    path = tmp_path / "manifest.sqlite"
    m = Manifest(path, {})
    m.put(table())
    m.close()
    if damage == "random":
        path.write_bytes(os.urandom(8192))
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:700])
    elif damage == "json":
        path.write_text('{"format_version": 1, "sessions": []}')
    elif damage == "version":
        with sqlite3.connect(path) as db:
            db.execute("UPDATE meta SET value = '99' WHERE key = 'format_version'")
    else:
        with sqlite3.connect(path) as db:
            db.execute("DROP TABLE sessions")
            db.execute("CREATE TABLE sessions (x)")
    if damage in ("version",):
        with pytest.raises(ManifestError):
            Manifest(path, {})
    fresh = open_or_set_aside(path, {}, sync=True)
    try:
        assert fresh.load() == [] or damage == "truncated"
    finally:
        fresh.close()
    if damage != "truncated":
        assert list(tmp_path.glob("manifest.sqlite.unreadable-*"))


def test_rows_that_do_not_read_back_are_skipped(tmp_path):
    path = tmp_path / "manifest.sqlite"
    m = Manifest(path, {})
    m.put(table())
    m.close()
    with sqlite3.connect(path) as db:
        db.execute("INSERT INTO sessions VALUES ('a', 'odd', 8, 0, 1.0, x'0102', x'')")  # not whole hashes
        db.execute("INSERT INTO sessions VALUES (7, 'num', 8, 0, 1.0, x'', x'')")  # not text
        db.execute("INSERT INTO sessions VALUES ('a', 'inf', 8, 0, 1e400, x'', x'')")
    got = loaded(path)
    assert ("a", "s1") in got and ("b", "s1") in got and ("a", "odd") not in got and len(got) <= 3


def test_the_session_table_keeps_at_most_max_sessions():
    t = SessionTable(max_sessions=3)
    for i in range(5):
        t.record("a", f"s{i}", [h(i)], 8)
    t.record("a", "s2", [h(2), h(9)], 16)  # used again: the newest
    t.record("a", "s5", [h(5)], 8)
    assert [w.session_id for w in t] == ["s4", "s2", "s5"]
    assert [w.session_id for w in t.take_evicted()] == ["s0", "s1", "s3"]
    assert isinstance(t.get("a", "s2"), Workspace)
