"""The remote tier through real `vllm serve` processes sharing one real Redis
server: a session whose steps alternate between two servers restores instead
of prefilling, a restarted server finds the history in Redis, tenants stay
apart, and Redis down, killed, flushed, evicting, slow or holding wrong values
costs only recomputation. Every answer equals a plain server's."""
import re
import sys
import threading
import time
from pathlib import Path

import pytest

from testbed.serving import LocalServer

from test_http_serve import VLLM_ARGS, post
from test_nvme_serve import answer, ask, history

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from redis_server import RedisServer  # noqa: E402

# Redis calls time out at 200 ms: run alone, not beside another engine (`serial`)
pytestmark = [pytest.mark.engine, pytest.mark.serial]

ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "SEKV_HASH_SECRET": "the fleet's shared secret"}
KEY = re.compile(r"^sekv:(b:[0-9a-f]{32}\.r0|s:[0-9a-f]{32}:[0-9a-f]{32})$")


def sekv(url):
    return {"host_bytes": "256M", "remote_url": url, "remote_timeout_ms": 200}


def restored(r, tier):
    return r["kv_transfer_params"]["sekv"]["restored_tokens"].get(tier, 0)


def wait_for_blocks(redis, prompt_tokens, timeout_s=60):
    """Until Redis holds a record for every full block of a prompt (written behind)."""
    deadline = time.monotonic() + timeout_s
    while len(redis.client().keys("sekv:b:*")) < prompt_tokens // 32 and time.monotonic() < deadline:
        time.sleep(0.2)


FAULTS = ("wrong values", "flushed", "slow", "evicting", "killed")


def variant(essay, k):
    """Another agent's text, for the fault cases (k = 0: the main session's)."""
    return essay[k * 30_000 :]


@pytest.fixture(scope="module")
def plain_answers(model_dir, essay):
    """Plain vLLM's answers: the main session's steps 1-4, and steps 2 and 3 of one variant per fault."""
    with LocalServer(model_dir, sekv=None, vllm_args=VLLM_ARGS, env=ENV) as server:
        main = [answer(ask(server.url, model_dir, history(essay, n))) for n in (1, 2, 3, 4)]
        faults = {k: [answer(ask(server.url, model_dir, history(variant(essay, k), n))) for n in (2, 3)]
                  for k in range(1, len(FAULTS) + 1)}
    return main, faults


@pytest.fixture(scope="module")
def fleet(model_dir, essay, tmp_path_factory):
    """Steps 1-3 alternate A, B, A; B restarts empty and takes step 4; tenant isolation."""
    out = {}
    with RedisServer(tmp_path_factory.mktemp("redis")) as redis:
        a = LocalServer(model_dir, sekv=sekv(redis.url), vllm_args=VLLM_ARGS, env=ENV).start()
        b = LocalServer(model_dir, sekv=sekv(redis.url), vllm_args=VLLM_ARGS, env=ENV).start()
        try:
            steps = []
            for n, server in ((1, a), (2, b), (3, a)):
                steps.append(ask(server.url, model_dir, history(essay, n)))
                wait_for_blocks(redis, steps[-1]["usage"]["prompt_tokens"])
            out["steps"] = steps
            out["other_tenant"] = post(b.url, "/v1/chat/completions", {
                "model": model_dir, "messages": history(essay, 3), "max_tokens": 12, "temperature": 0,
                "cache_salt": "another tenant"})
            b.stop()
            b = LocalServer(model_dir, sekv=sekv(redis.url), vllm_args=VLLM_ARGS, env=ENV).start()
            out["restarted"] = ask(b.url, model_dir, history(essay, 4))
            out["keys"] = [k.decode() for k in redis.client().keys("*")]
            out["redis"] = redis
            yield a, b, redis, out
        finally:
            a.stop()
            b.stop()


def test_a_session_alternating_servers_restores_every_step_after_the_first(fleet, plain_answers):
    _, _, _, out = fleet
    steps = out["steps"]
    assert [answer(r) for r in steps] == plain_answers[0][:3]
    assert restored(steps[0], "remote") == 0
    for prev, step in zip(steps, steps[1:]):
        held = prev["usage"]["prompt_tokens"] // 32 * 32  # every full block of the last step's prompt
        assert restored(step, "host") + restored(step, "remote") >= held
        assert restored(step, "remote") > 0  # what the other server computed came from Redis
        params = step["kv_transfer_params"]["sekv"]
        assert params["prefilled_tokens"] <= step["usage"]["prompt_tokens"] - held


def test_a_server_restarted_empty_restores_from_redis(fleet, plain_answers):
    _, _, _, out = fleet
    r = out["restarted"]
    assert answer(r) == plain_answers[0][3]
    assert restored(r, "remote") >= out["steps"][2]["usage"]["prompt_tokens"] // 32 * 32


def test_tenants_never_read_each_others_blocks_and_keys_hold_no_names(fleet):
    _, _, _, out = fleet
    assert restored(out["other_tenant"], "remote") == 0 and restored(out["other_tenant"], "host") == 0
    assert out["keys"] and all(KEY.match(k) for k in out["keys"])


def test_redis_faults_cost_only_recomputation(fleet, model_dir, essay, plain_answers):
    """For each fault: server A computes an agent's step 2 (its blocks go to
    Redis), the fault strikes, server B (which holds none of it) takes step 3."""
    a, b, redis, _ = fleet
    client = redis.client()
    got = {}
    for k, fault in enumerate(FAULTS, start=1):
        text, session = variant(essay, k), f"agent-{k}"
        first = ask(a.url, model_dir, history(text, 2), session_id=session)
        wait_for_blocks(redis, first["usage"]["prompt_tokens"])
        blocker = None
        if fault == "wrong values":  # every record replaced by another block's (valid) record
            keys = client.keys("sekv:b:*")
            records = [client.get(key) for key in keys]
            for key, record in zip(keys, records[1:] + records[:1]):  # none keeps its own
                client.set(key, record)
        elif fault == "flushed":
            client.flushall()
        elif fault == "slow":  # Redis blocked while the step is served: lookups and reads time out
            blocker = threading.Thread(target=lambda: redis.cli("DEBUG", "SLEEP", "3"))
            blocker.start()
            time.sleep(0.3)
        elif fault == "evicting":  # a 1 MiB Redis under allkeys-lru holds almost nothing
            redis.cli("CONFIG", "SET", "maxmemory-policy", "allkeys-lru")
            redis.cli("CONFIG", "SET", "maxmemory", "1mb")
        elif fault == "killed":
            redis.kill()
        second = ask(b.url, model_dir, history(text, 3), session_id=session)
        if blocker is not None:
            blocker.join()
        if fault == "evicting":
            redis.cli("CONFIG", "SET", "maxmemory", "0")
        got[fault] = (answer(first), answer(second), restored(second, "remote"))
    redis.start()  # back, empty: served throughout
    again = ask(b.url, model_dir, history(variant(essay, 1), 3), session_id="agent-1")
    for k, fault in enumerate(FAULTS, start=1):
        assert got[fault][:2] == tuple(plain_answers[1][k]), fault
    assert got["wrong values"][2] == 0 and got["flushed"][2] == 0 and got["killed"][2] == 0
    assert answer(again) == plain_answers[1][1][1]
    for server in (a, b):
        assert server.proc.poll() is None
    logs = a.log_path.read_text(errors="replace") + b.log_path.read_text(errors="replace")
    assert "sekv remote" in logs and "is a miss" in logs
