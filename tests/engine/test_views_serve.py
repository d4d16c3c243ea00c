"""Execution views through the OpenAI endpoint of a real `vllm serve`.

One sekv server whose `--max-model-len` (32768, with
`VLLM_ALLOW_LONG_MAX_MODEL_LEN=1`) is four times SmolLM2's native window
(8192): views keep every forward pass inside the window, so its KV cache
(1 GiB: about 23K float32 tokens, fewer than `--max-model-len`; plain vLLM
would refuse to start) need only hold the window. The 16K reader
session of `views_session.py`: requests ask for a 4096-token view budget; a
pass key sits in an early document, more than the native window back from
the question. float32: in bf16 the 135M model's answer with the pass key's
block in view depends on the CPU's kernels (right on an AVX-512 CPU, wrong
on an AVX2 one).
"""
import pytest

from views_session import NATIVE_WINDOW, VIEW, needle_block, run_reader_session
from views_session import sekv_params as sekv

pytestmark = pytest.mark.engine

VLLM_ARGS = ["--max-model-len", "32768", "--enforce-eager", "--dtype", "float32",
             "--gpu-memory-utilization", "0.5"]
ENV = {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "SEKV_HOST_BYTES": "2G"}


@pytest.fixture(scope="module")
def session(model_dir, eval_tasks):
    return run_reader_session(model_dir, eval_tasks, {}, VLLM_ARGS, ENV)


def test_every_step_of_a_16k_session_is_served_from_views(session):
    _, task, steps, _, answer, _ = session
    assert task.prompt_tokens >= 2 * NATIVE_WINDOW
    for r in steps + [answer]:
        assert r["choices"][0]["finish_reason"] in ("length", "stop")
        view = sekv(r).get("view")
        if r["usage"]["prompt_tokens"] > VIEW["view_tokens"]:
            assert view is not None and view["passes"]["final"] == 1
            assert view["view_tokens"] <= VIEW["view_tokens"]
    # Later steps restore their history from the workspace instead of recomputing it.
    assert sekv(answer)["prefilled_tokens"] < 200
    assert sekv(answer)["restored_tokens"]["host"] > VIEW["view_tokens"] - 512


def test_the_probe_never_reaches_the_client(session):
    _, _, _, one, answer, _ = session
    # With max_tokens=1 a leaked probe token would end the request before its
    # final pass; instead the one token is the first of the longer answer.
    assert one["usage"]["completion_tokens"] == 1
    assert sekv(one)["view"]["passes"] == {"probe": 1, "final": 1}
    (probe, chosen, done), (final, final_chosen, final_done) = sekv(one)["view"]["pass_seconds"]
    assert (probe, final, final_done) == ("probe", "final", None)
    assert 0 <= chosen <= done <= final_chosen
    first = one["choices"][0]["message"]["content"]
    assert first and answer["choices"][0]["message"]["content"].startswith(first)


def test_a_fact_beyond_the_native_window_is_selected_and_answered(session, eval_tasks):
    tok, task, _, _, answer, _ = session
    block, distance = needle_block(tok, eval_tasks, task)
    assert distance > NATIVE_WINDOW  # the fact lies beyond the model's window
    view = sekv(answer)["view"]
    assert block in view["selected_blocks"]
    # the selection's own order: its blocks, sink and recent aside, the fact's among them
    assert block in view["ranked_blocks"] and set(view["ranked_blocks"]) < set(view["selected_blocks"])
    assert eval_tasks.is_correct(task.answer, answer["choices"][0]["message"]["content"])


def test_an_edited_history_truncates_the_workspace_and_still_answers(session, eval_tasks):
    tok, task, _, _, answer, after_edit = session
    view = sekv(after_edit)["view"]
    assert 2 * NATIVE_WINDOW - 1024 < after_edit["usage"]["prompt_tokens"] < answer["usage"]["prompt_tokens"]
    # The kept history is restored, not recomputed; only the question is new.
    assert sekv(after_edit)["prefilled_tokens"] < 200
    assert sekv(after_edit)["restored_tokens"]["host"] > VIEW["view_tokens"] - 512
    block, _ = needle_block(tok, eval_tasks, task)
    assert block in view["selected_blocks"]
    assert eval_tasks.is_correct(task.answer, after_edit["choices"][0]["message"]["content"])


def test_a_views_restore_ms_counts_every_pass(session):
    """A view's response reports all its passes' restore time (the probe's
    and the final pass's, which vLLM hands over after the request finished):
    the same time the server's restore counter added for it."""
    _, _, _, one, _, _ = session
    assert sekv(one)["view"]["passes"] == {"probe": 1, "final": 1}
    counted_ms = one["restore_seconds_counted"] * 1000
    assert counted_ms > 0
    assert sekv(one)["restore_ms"] == pytest.approx(counted_ms, rel=1e-3, abs=0.01)
