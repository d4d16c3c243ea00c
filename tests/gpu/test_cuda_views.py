"""Execution views on CUDA, through a real `vllm serve` (run on the GPU
machine by benchmarks/gpu/device/run_e2e.sh; skipped without CUDA).

The 16K reader session of tests/engine/views_session.py, on SmolLM2 in bf16
with piecewise CUDA graphs (the attention hook and the surprisal hook run
between graph pieces): probes score the index on the queries the hook sees,
final views restore re-RoPE'd history from the pinned pool (scattered blocks:
batched restores), every step stays inside the model's window. Served three times:
with the default index, and with SeKV surprisal on (anchor summaries, anchor
tokens in the views), and with SeKV's coarse summaries (merged by the
Triton kernel) and lowrank restores. With a resident pool (diff restores)
the default index's session gives the same responses, token for token, while
later views place blocks from the device. From the fp8 workspace the
distant fact is still selected and answered.
"""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from views_session import NATIVE_WINDOW, VIEW, needle_block, run_reader_session  # noqa: E402
from views_session import sekv_params as sekv  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.engine,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

VLLM_ARGS = ["--max-model-len", "32768", "--dtype", "bfloat16", "--gpu-memory-utilization", "0.4"]
ENV = {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1", "SEKV_HOST_BYTES": "4G"}
CONFIGS = {
    "mean-k": {},
    "sekv": {"surprisal": "on", "index_summary": "anchor_pre", "index_combine": "top8"},
    # Coarse summaries merged by the Triton kernel in the attention hook, and
    # selected history rebuilt on the GPU from host-side lowrank factors.
    "sekv-coarse": {"surprisal": "on", "coarse": "on", "restore_codec": "lowrank(16)",
                    "index_summary": "sub8a_pre", "index_combine": "max"},
    # Diff restores: blocks of earlier views kept on the device.
    "mean-k-resident": {"resident_bytes": "512M"},
    # Views from the fp8 workspace: fp8 bytes restored batched and layer by
    # layer, dequantized and re-RoPE'd on the device, incomplete blocks from
    # their tails.
    "mean-k-fp8": {"workspace_codec": "fp8"},
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def session(request, model_dir, eval_tasks):
    return request.param, run_reader_session(model_dir, eval_tasks, CONFIGS[request.param], VLLM_ARGS, ENV)


def test_every_step_is_served_from_a_view_inside_the_window(session):
    _, (_, task, steps, one, answer, _) = session
    assert task.prompt_tokens >= 2 * NATIVE_WINDOW
    for r in steps + [answer]:
        view = sekv(r).get("view")
        if r["usage"]["prompt_tokens"] > VIEW["view_tokens"]:
            assert view is not None and view["passes"]["final"] == 1
            assert view["view_tokens"] <= VIEW["view_tokens"]
    assert sekv(answer)["prefilled_tokens"] < 200
    assert one["usage"]["completion_tokens"] == 1 and sekv(one)["view"]["passes"] == {"probe": 1, "final": 1}
    assert answer["choices"][0]["message"]["content"].startswith(one["choices"][0]["message"]["content"])


def test_the_distant_fact_is_selected_and_answered(session, eval_tasks):
    name, (tok, task, _, _, answer, after_edit) = session
    block, distance = needle_block(tok, eval_tasks, task)
    assert distance > NATIVE_WINDOW
    assert block in sekv(answer)["view"]["selected_blocks"]
    if name != "sekv-coarse":  # lossy by design: whether it still answers is benchmarks/eval's question
        assert eval_tasks.is_correct(task.answer, answer["choices"][0]["message"]["content"])
        assert eval_tasks.is_correct(task.answer, after_edit["choices"][0]["message"]["content"])
    if name.startswith("sekv"):
        assert 0 < sekv(answer)["view"].get("anchor_tokens", 0) <= VIEW["view_tokens"] * 6 // 100
    if name == "sekv-coarse":
        view = sekv(answer)["view"]
        assert 0 < view["summaries"] <= VIEW["view_tokens"] // 10
        assert view["view_tokens"] + view["summaries"] <= VIEW["view_tokens"]


def test_resident_blocks_serve_the_same_views_with_fewer_bytes_moved(session, model_dir, eval_tasks):
    """The same session with and without the resident pool: every response the
    same, token for token; the resident one placed blocks from the device and
    moved fewer bytes over PCIe."""
    name, (_, _, steps, one, answer, after_edit) = session
    if name != "mean-k-resident":
        pytest.skip("compares the resident session with the default one")
    _, _, base_steps, base_one, base_answer, base_edit = run_reader_session(model_dir, eval_tasks, CONFIGS["mean-k"],
                                                                           VLLM_ARGS, ENV)
    for got, want in zip([*steps, one, answer, after_edit], [*base_steps, base_one, base_answer, base_edit]):
        assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    for r in [*steps, one, answer, after_edit]:  # blocks placed: of the blocks the response says were restored
        params = sekv(r)
        restored = sum(params["restored_tokens"].values())
        assert params["resident_blocks"] <= -(-restored // params.get("view", {}).get("block_tokens", 32))
    counts, base = after_edit["server_metrics"], base_edit["server_metrics"]
    assert counts.get("vllm:sekv_resident_blocks_total", 0) > 0
    assert counts["vllm:sekv_restored_bytes_total"] < base["vllm:sekv_restored_bytes_total"]
