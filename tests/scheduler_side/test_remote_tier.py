"""The remote tier's scheduler side on a real Redis: what a prompt's blocks
the store holds, named sessions' rows, and a store that is down."""
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from redis_server import RedisServer  # noqa: E402

from vllm_sekv.config import SekvConfig  # noqa: E402
from vllm_sekv.scheduler_side.remote_lookup import RemoteTier  # noqa: E402
from vllm_sekv.store.remote import record_key  # noqa: E402
from vllm_sekv.workspace.sessions import Workspace  # noqa: E402
from vllm_sekv.workspace.tenants import TenantKeys  # noqa: E402

# bounded-time checks (a timeout, a back-off): run alone, not beside an engine (`serial`)
pytestmark = pytest.mark.serial

H = [bytes([i]) * 16 for i in range(1, 200)]


@pytest.fixture
def redis_server(tmp_path):
    with RedisServer(tmp_path / "redis") as server:
        yield server


def tier(url):
    config = SekvConfig(remote_url=url, hash_secret="a shared secret!", remote_timeout_ms=200)
    return RemoteTier(config, TenantKeys(b"a shared secret!"))


def test_lookup_counts_the_leading_blocks_the_store_holds(redis_server):
    t = tier(redis_server.url)
    client = redis_server.client()
    for h in H[:100] + H[101:120]:  # a gap at 100
        client.set(record_key("sekv:", h, 0), b"x")
    assert t.lookup(H[:150], "tenant", None) == 100
    assert t.lookup(H[101:150], "tenant", None) == 19
    assert t.lookup([], "tenant", None) == 0
    t.close()


def test_a_named_sessions_row_moves_it_between_servers(redis_server):
    a, b = tier(redis_server.url), tier(redis_server.url)
    a.put_session(Workspace("tenant", "agent-7", H[:30], 30 * 32))
    deadline = time.monotonic() + 5
    while not redis_server.client().keys("sekv:s:*") and time.monotonic() < deadline:
        time.sleep(0.05)
    (key,) = redis_server.client().keys("sekv:s:*")
    assert b"agent-7" not in key  # a keyed digest, never the session id
    # the row lists the history: the other server takes it as held without asking block by block
    assert b.lookup(H[:40], "tenant", "agent-7") == 30
    assert b.lookup(H[:40], "another tenant", "agent-7") == 0  # a row is one tenant's
    a.close()
    b.close()


def test_a_store_that_is_down_costs_one_timeout_then_nothing(redis_server):
    t = tier(redis_server.url)
    redis_server.kill()
    t0 = time.monotonic()
    assert t.lookup(H[:10], "tenant", None) == 0
    first = time.monotonic() - t0
    t0 = time.monotonic()
    assert t.lookup(H[:10], "tenant", None) == 0
    assert first < 1.0 and time.monotonic() - t0 < 0.01 and t.failures == 1
    t.close()
