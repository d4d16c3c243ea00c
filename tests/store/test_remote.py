"""The remote tier on a real Redis server: the store's batched calls, the
worker's reads and writes into host slots, and every way the store can fail
or lie turning into a miss, within a bounded time."""
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from redis_server import RedisServer  # noqa: E402

from vllm_sekv.store import HostPool  # noqa: E402
from vllm_sekv.store.records import RecordLayout  # noqa: E402
from vllm_sekv.store.remote import RedisStore, RemoteHealth, RemoteUnavailable, check_url, record_key  # noqa: E402
from vllm_sekv.store.remote_io import RemoteIO  # noqa: E402

# bounded-time checks (a timeout, a back-off): run alone, not beside an engine (`serial`)
pytestmark = pytest.mark.serial

H = [bytes([i]) * 16 for i in range(8)]
TENANT, OTHER = b"\xaa" * 16, b"\xbb" * 16


@pytest.fixture
def redis_server(tmp_path):
    with RedisServer(tmp_path / "redis") as server:
        yield server


def make_io(url, timeout_s=1.0):
    pool = HostPool(8, num_layers=2, block_tokens=8, kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    pool.data.copy_(torch.randn(pool.data.shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16))
    io = RemoteIO(RedisStore(url, timeout_s), pool.data, RecordLayout.of_pool(b"\x11" * 32, pool.data, 0), "t:",
                  threads=2, batch_blocks=3)
    return pool, io


def round_trip(io, writes, reads):
    io.submit_writes(writes)
    w = io.drain(wait=True)
    io.submit_reads(reads)
    return w, io.drain(wait=True)


def test_urls_are_checked():
    check_url("redis://localhost:6379/0")
    check_url("rediss://user:pw@host:6380/1")
    check_url("unix:///run/redis.sock")
    for bad in ("http://x", "redis://", "localhost:6379"):
        with pytest.raises(ValueError, match="remote_url"):
            check_url(bad)


def test_the_store_answers_in_batches(redis_server):
    store = RedisStore(redis_server.url)
    store.put({"a": b"1", "b": b"22"})
    assert store.contains(["a", "x", "b"]) == [True, False, True]
    assert store.get(["b", "x"]) == [b"22", None]
    store.delete(["a"])
    assert store.contains(["a"]) == [False]
    ttl = RedisStore(redis_server.url, ttl_s=100)
    ttl.put({"c": b"3"})
    assert 0 < int(redis_server.cli("TTL", "c")) <= 100


def test_records_round_trip_bit_identically(redis_server):
    pool, io = make_io(redis_server.url)
    original = pool.data[:4].clone()
    writes, reads = round_trip(io, [(s, H[s], 8 * s, TENANT) for s in range(4)],
                               [(4 + s, H[s], 8 * s, TENANT) for s in range(4)])
    assert all(c.ok for c in writes + reads)
    assert torch.equal(pool.data[4:8].view(torch.int16), original.view(torch.int16))
    assert redis_server.client().exists(record_key("t:", H[0], 0))


def test_every_lie_or_loss_of_the_store_is_a_miss(redis_server):
    pool, io = make_io(redis_server.url)
    round_trip(io, [(s, H[s], 8 * s, TENANT) for s in range(4)], [])
    client = redis_server.client()
    key = lambda i: record_key("t:", H[i], 0)  # noqa: E731
    client.set(key(1), client.get(key(2)))  # a valid record of another block under this block's key
    value = bytearray(client.get(key(3)))
    value[5000] ^= 1
    client.set(key(3), bytes(value))  # a flipped payload bit
    client.set(key(0), b"garbage")
    _, reads = round_trip(io, [], [(4, H[0], 0, TENANT), (5, H[1], 8, TENANT), (6, H[3], 24, TENANT),
                                   (7, H[2], 16, OTHER)])  # ... and a record read for another tenant
    assert [c.ok for c in reads] == [False] * 4
    assert {c.reason for c in reads} >= {"a value of 7 bytes", "the record is another block's", "checksum mismatch"}
    client.flushall()
    _, reads = round_trip(io, [], [(4, H[2], 16, TENANT)])
    assert not reads[0].ok and "not in the remote store" in reads[0].reason


def test_a_store_that_is_down_or_slow_fails_within_the_timeout_and_is_left_alone(redis_server):
    pool, io = make_io(redis_server.url, timeout_s=0.3)
    blocker = threading.Thread(target=lambda: redis_server.cli("DEBUG", "SLEEP", "2"))
    blocker.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    writes, _ = round_trip(io, [(0, H[0], 0, TENANT)], [])
    assert not writes[0].ok and time.monotonic() - t0 < 1.5
    t0 = time.monotonic()
    _, reads = round_trip(io, [], [(1, H[0], 0, TENANT)])  # backing off: fails at once
    assert not reads[0].ok and "backing off" in reads[0].reason and time.monotonic() - t0 < 0.2
    blocker.join()
    redis_server.kill()
    store = RedisStore(redis_server.url, timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(RemoteUnavailable):
        store.get(["x"])
    assert time.monotonic() - t0 < 1.0


def test_the_back_off_doubles_and_a_success_resets_it():
    health = RemoteHealth(min_backoff_s=0.05, max_backoff_s=0.2)
    assert health.up()
    assert health.failed() == 0.05 and not health.up()
    assert health.failed() == 0.1 and health.failed() == 0.2 and health.failed() == 0.2
    health.ok()
    assert health.up()
