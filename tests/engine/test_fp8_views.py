"""Execution views from an fp8 workspace through a real `vllm serve`: the 16K
reader session of `views_session.py` (as `test_views_serve.py` serves it from
the exact workspace) with `workspace_codec` fp8. Every view is restored from
fp8 K/V, keys re-RoPE'd to the view's positions: the pass key, more than the
native window back, is selected and answered. Over an fp8 paged cache
(`--kv-cache-dtype fp8`) the same, from the cache's own bytes."""
import pytest

from test_views_serve import ENV, VLLM_ARGS
from testbed.hardware import FP8_CACHE_SKIP_REASON, fp8_kv_cache_supported
from views_session import NATIVE_WINDOW, VIEW, needle_block, run_reader_session
from views_session import sekv_params as sekv

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def session(model_dir, eval_tasks):
    return run_reader_session(model_dir, eval_tasks, {"workspace_codec": "fp8"}, VLLM_ARGS, ENV)


def test_a_view_from_the_fp8_workspace_answers_a_fact_beyond_the_native_window(session, eval_tasks):
    tok, task, _, _, answer, _ = session
    block, distance = needle_block(tok, eval_tasks, task)
    assert distance > NATIVE_WINDOW
    assert sekv(answer)["prefilled_tokens"] < 200  # the view was restored, not recomputed
    assert block in sekv(answer)["view"]["selected_blocks"]
    assert eval_tasks.is_correct(task.answer, answer["choices"][0]["message"]["content"]), answer["choices"]


@pytest.fixture(scope="module")
def session_over_fp8_cache(model_dir, eval_tasks):
    if not fp8_kv_cache_supported():
        pytest.skip(FP8_CACHE_SKIP_REASON)
    return run_reader_session(model_dir, eval_tasks, {"workspace_codec": "fp8"},
                              VLLM_ARGS + ["--kv-cache-dtype", "fp8"], ENV, {**VIEW, "view_cut_lines": True})


def test_over_an_fp8_kv_cache_a_view_of_the_caches_own_bytes_answers_the_same_fact(session_over_fp8_cache,
                                                                                    eval_tasks):
    """`--kv-cache-dtype fp8`: the workspace keeps the cache's bytes, and a
    view restores them with keys dequantized, re-RoPE'd and rounded again
    to the layer scale; the pass key is selected and answered as above.

    The pass key's line ("The pass key is N. Remember it. N is the pass
    key.") spans two blocks, and SmolLM2 answers from this view only with
    both. Which of the near-tied blocks the index ranks in depends on the
    cache's fp8 bytes, which depend on the CPU's thread count (one thread
    per engine under pytest-xdist, two alone): the requests cut no lines
    (`view_cut_lines`), so the view holds the whole line and the answer
    tests the restored bytes, not the tie."""
    tok, task, _, _, answer, _ = session_over_fp8_cache
    block, _ = needle_block(tok, eval_tasks, task)
    assert sekv(answer)["prefilled_tokens"] < 200
    assert {block, block + 1} <= set(sekv(answer)["view"]["selected_blocks"])
    assert eval_tasks.is_correct(task.answer, answer["choices"][0]["message"]["content"]), answer["choices"]
