"""Randomized fault injection against a real `vllm serve` (benchmarks/faults/harness.py),
bounded for CI: a few hundred seeded faults on the records, folders, disk and
manifest, between and during requests, two kills of the server (one while a
request runs) and restarts on the same folder. Every answer must equal plain
vLLM's greedy answer token for token; the server must never crash or fail to
start, and must restore from disk after the last restart (a session the
faults never touched, written behind just before it). The long run is
`python benchmarks/faults/run.py` (results in benchmarks/results/faults/)."""
import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

HARNESS = Path(__file__).resolve().parents[2] / "benchmarks" / "faults" / "harness.py"


@pytest.fixture(scope="module")
def harness():
    spec = importlib.util.spec_from_file_location("fault_harness", HARNESS)
    module = importlib.util.module_from_spec(spec)
    sys.modules["fault_harness"] = module
    spec.loader.exec_module(module)
    return module


def test_seeded_faults_never_cost_a_wrong_token_a_crash_or_a_failed_start(harness, model_dir, essay, tmp_path):
    sys.path.insert(0, str(HARNESS.parent))
    from run import ENV, SEKV, VLLM_ARGS

    steps = harness.sessions(essay, tenants=2, per_tenant=1, steps=4)
    survivor = harness.sessions(essay, tenants=1, per_tenant=1, steps=2, skip_chars=2 * 4 * 1400, name="survivor")[0]
    run = harness.FaultRun(model_dir, tmp_path, seed=1, vllm_args=VLLM_ARGS, env=ENV, sekv_config=SEKV)
    try:
        run.compute_reference([s for session in steps for s in session] + survivor)
        c = run.run(250, steps, requests_per_fault=0.12, max_kills=2, survivor=survivor)
    finally:
        run.close()
    print(c.summary())
    assert c.faults_injected >= 250 and c.kills >= 2 and c.requests >= 30
    assert c.wrong_tokens == 0 and c.engine_crashes == 0 and c.failed_startups == 0 and c.refused_requests == 0
    assert c.restored_after_restart_tokens > 0  # the survivor's history came back from disk after the last restart
