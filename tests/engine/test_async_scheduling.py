"""sekv under vLLM's asynchronous scheduler, the mode vLLM runs on GPUs.

With asynchronous scheduling vLLM schedules step N+1 before step N's output
comes back, so a request's `num_computed_tokens` counts tokens still being
computed. A view pass judged complete on that count was taken out of the
engine one step early: its last chunk's captures were never committed, and
the next pass found the history gone (the first view step on the H200 never
finished). The same 3-step session runs here under both schedulers (vLLM's
CPU build turns asynchronous scheduling off; `session_runner` lifts that one
override), with vLLM's prefix cache reset before every step:

* restore (no views): greedy outputs equal plain vLLM prefilling everything,
  and later steps compute only their new tokens;
* views of 512 tokens (every step is served from views: ingest, probe,
  final): outputs, passes, selected blocks and restored tokens equal the
  synchronous scheduler's.
"""
import pytest

from engine_process import run_runner

pytestmark = pytest.mark.engine

BLOCK_TOKENS = 32
RESTORE = {"host_bytes": "512M", "block_tokens": BLOCK_TOKENS}
VIEWS = {**RESTORE, "view_tokens": 512}


def run_session(tmp, model_dir, essay, sekv, async_scheduling: bool, name: str) -> dict:
    turns = [essay[:3000], "\n\nTool output:\n" + essay[3000:5000], "\n\nTool output:\n" + essay[5000:6500]]
    spec = {"model": model_dir, "sekv": sekv, "turns": turns, "max_tokens": 24, "salt": "tenant-a",
            "other_salt": "tenant-b", "dtype": "float32", "async_scheduling": async_scheduling}
    return run_runner("session_runner.py", spec, tmp, name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, model_dir, essay) -> dict:
    tmp = tmp_path_factory.mktemp("async")
    return {
        "plain": run_session(tmp, model_dir, essay, None, False, "plain"),
        "restore_async": run_session(tmp, model_dir, essay, RESTORE, True, "restore-async"),
        "views_sync": run_session(tmp, model_dir, essay, VIEWS, False, "views-sync"),
        "views_async": run_session(tmp, model_dir, essay, VIEWS, True, "views-async"),
    }


def test_the_engines_ran_the_scheduler_asked_for(runs):
    for name in ("restore_async", "views_async"):
        assert runs[name]["scheduler"] == {"class": "vllm_sekv.scheduler_side.engine_scheduler.SekvAsyncScheduler",
                                           "async_scheduling": True}
    assert runs["views_sync"]["scheduler"] == {"class": "vllm_sekv.scheduler_side.engine_scheduler.SekvScheduler",
                                               "async_scheduling": False}


def test_restore_under_async_scheduling_equals_plain_vllm(runs):
    plain, sekv = runs["plain"]["steps"], runs["restore_async"]["steps"]
    assert [s["output_token_ids"] for s in sekv] == [p["output_token_ids"] for p in plain]
    for prev, step in zip(sekv, sekv[1:]):
        computed_before = len(prev["prompt_token_ids"]) + len(prev["output_token_ids"]) - 1
        restorable = computed_before // BLOCK_TOKENS * BLOCK_TOKENS
        assert step["num_cached_tokens"] == restorable
        assert step["kv_transfer_params"]["sekv"]["restored_tokens"]["host"] == restorable


def untimed(view: dict) -> dict:
    return {k: v for k, v in view.items() if k != "pass_seconds"}


def test_views_under_async_scheduling_equal_the_synchronous_scheduler(runs):
    sync, asyn = runs["views_sync"]["steps"], runs["views_async"]["steps"]
    for i, (s, a) in enumerate(zip(sync, asyn)):
        sv, av = s["kv_transfer_params"]["sekv"], a["kv_transfer_params"]["sekv"]
        assert "truncated" not in av["view"], f"step {i}: the workspace lost the history"
        assert sv["view"]["passes"]["final"] == 1 and "probe" in sv["view"]["passes"]
        # passes, selected blocks: all but when each pass ran
        assert untimed(av["view"]) == untimed(sv["view"]), f"step {i}"
        assert [p[0] for p in av["view"]["pass_seconds"]] == [p[0] for p in sv["view"]["pass_seconds"]]
        assert av["restored_tokens"] == sv["restored_tokens"], f"step {i}"
        assert a["output_token_ids"] == s["output_token_ids"], f"step {i}"
    assert len(asyn) == 3
