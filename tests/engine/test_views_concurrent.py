"""Views under concurrency, on the real vLLM engine and SmolLM2, float32.

Four agent sessions, each a long history with a fact of its own and two
steps served from 384-token views. One engine serves them one request at a
time, then (another tenant, so every history is ingested again) all four
sessions' requests at once, their passes interleaved in vLLM's batches: a
view must not depend on what else runs beside it, so every step's selection
and output must be the same.
"""
import pytest

from engine_process import run_runner

pytestmark = pytest.mark.engine

SEKV = {"host_bytes": "512M", "block_tokens": 32, "view_tokens": 384, "sink_tokens": 64, "recent_tokens": 64,
        "rerank_blocks": 64}
SESSIONS = 4


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_dir, essay):
    sessions = []
    for i in range(SESSIONS):
        text = essay[i * 9000 : i * 9000 + 8000]
        history = text[:6000] + f" The vault code of unit {i} is {4000 + 37 * i}. " + text[6000:]
        sessions.append([history + f"\n\nQuestion: what is the vault code of unit {i}?\nAnswer:",
                         f"\n\nTool output: done.\nQuestion: again, the vault code of unit {i}?\nAnswer:"])
    spec = {"model": model_dir, "sekv": SEKV, "sessions": sessions, "max_tokens": 8, "dtype": "float32"}
    return run_runner("concurrent_runner.py", spec, tmp_path_factory.mktemp("views-concurrent"), "views-concurrent")


def test_every_step_is_served_from_a_view(served):
    for run in ("serial", "together"):
        for step in served[run]:
            for out in step:
                assert out["view"] is not None
                assert out["view"]["pass_seconds"][-1][0] == "final"


def test_the_sessions_passes_ran_side_by_side(served):
    """Admitted together, every request began its first pass before any of them reached its final pass."""
    for step in served["together"]:
        timelines = [out["view"]["pass_seconds"] for out in step]
        assert max(t[0][1] for t in timelines) < min(t[-1][1] for t in timelines)


def test_views_served_together_select_and_answer_as_views_served_alone(served):
    for alone, together in zip(served["serial"], served["together"]):
        assert [o["view"]["selected_blocks"] for o in together] == [o["view"]["selected_blocks"] for o in alone]
        assert [o["output_token_ids"] for o in together] == [o["output_token_ids"] for o in alone]
