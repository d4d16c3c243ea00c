"""The plugin inside real vLLM on CUDA (run on the GPU machine by
benchmarks/gpu/device/run_e2e.sh; skipped without CUDA).

The same 3-step agent session as tests/engine/test_restore_offline.py, on
SmolLM2 in bf16, vLLM's GPU prefix cache reset before every step. The CUDA
path is the one users get: pinned host pool, restores on a copy stream written
by the FlashAttention backend's own cache-update op — layer by layer behind the
forward (`restore_mode` layerwise) and, in a second run, batched before it — captures by the attention hook. Workspace blocks of 16 tokens match vLLM's
16-token pages on CUDA, so sekv restores exactly the tokens vLLM's own prefix
cache would hold and the computed remainder is the same.
"""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from engine_process import run_runner  # noqa: E402
from vllm_sekv.store import HostPool  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.engine,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BLOCK_TOKENS = 16
SEKV = {"host_bytes": "2G", "block_tokens": BLOCK_TOKENS, "restore_mode": "layerwise"}
SEKV_BATCHED = {**SEKV, "restore_mode": "batched"}


def run_session(tmp_path, model_dir, essay, sekv, reset, cudagraph_mode=None, kv_cache_dtype=None):
    turns = [essay[:3000], "\n\nTool output:\n" + essay[3000:5000], "\n\nTool output:\n" + essay[5000:6500]]
    spec = {"model": model_dir, "sekv": sekv, "turns": turns, "max_tokens": 24, "cudagraph_mode": cudagraph_mode,
            "salt": "tenant-a", "other_salt": "tenant-b", "dtype": "bfloat16", "reset": reset,
            "kv_cache_dtype": kv_cache_dtype}
    name = f"{'sekv-' + sekv.get('restore_mode', 'auto') if sekv is not None else 'plain'}-{'reset' if reset else 'warm'}"
    name += f"-{cudagraph_mode.lower()}" if cudagraph_mode else ""
    name += f"-{kv_cache_dtype}" if kv_cache_dtype else ""
    return run_runner("session_runner.py", spec, tmp_path, name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, model_dir, essay):
    tmp = tmp_path_factory.mktemp("cuda_sessions")
    warm = run_session(tmp, model_dir, essay, None, reset=False)
    cold = run_session(tmp, model_dir, essay, None, reset=True)
    sekv = run_session(tmp, model_dir, essay, SEKV, reset=True)
    batched = run_session(tmp, model_dir, essay, SEKV_BATCHED, reset=True)
    return warm, cold, sekv, batched


@pytest.mark.parametrize("mode", ["layerwise", "batched"])
def test_greedy_outputs_equal_plain_vllm_with_its_prefix_cache(runs, mode):
    warm, _, layerwise, batched = runs
    sekv = layerwise if mode == "layerwise" else batched
    assert warm["steps"][2]["num_cached_tokens"] > 0  # vLLM's own cache served the history
    for w, s in zip(warm["steps"], sekv["steps"]):
        assert s["prompt_token_ids"] == w["prompt_token_ids"]
        assert s["output_token_ids"] == w["output_token_ids"]
        assert s["num_cached_tokens"] == w["num_cached_tokens"]


def test_plain_vllm_recomputes_everything_after_a_gpu_cache_reset(runs):
    cold = runs[1]
    assert all(step["num_cached_tokens"] == 0 for step in cold["steps"])


def test_restore_after_a_gpu_cache_reset_computes_only_new_tokens(runs):
    sekv = runs[2]
    steps = sekv["steps"]
    for prev, step in zip(steps, steps[1:]):
        computed_before = len(prev["prompt_token_ids"]) + len(prev["output_token_ids"]) - 1
        restorable = computed_before // BLOCK_TOKENS * BLOCK_TOKENS
        assert step["num_cached_tokens"] == restorable
        params = step["kv_transfer_params"]["sekv"]
        assert params["restored_tokens"]["host"] == restorable
        assert params["prefilled_tokens"] == len(step["prompt_token_ids"]) - restorable
        assert params["restore_ms"] > 0


def test_tenants_with_different_salts_never_share_blocks(runs):
    sekv = runs[2]
    assert sekv["probe"]["other_salt"]["num_cached_tokens"] == 0
    assert sekv["probe"]["same_salt"]["num_cached_tokens"] > 0


def test_under_cuda_graphs_outputs_equal_plain_vllm_and_restores_compute_only_new_tokens(tmp_path, model_dir, essay):
    """With vLLM's default CUDA graphs on GPUs: piecewise graphs for prefills
    (attention, the KV-cache update and sekv's hook outside them) and full
    graphs for decode batches, whose tokens sekv captures around the graph.
    Every step's decoded tokens come back restored, so those captures landed;
    the reference runs the same graph mode, so that both compute with the
    same kernels."""
    warm = run_session(tmp_path, model_dir, essay, None, reset=False, cudagraph_mode="FULL_AND_PIECEWISE")
    sekv = run_session(tmp_path, model_dir, essay, SEKV, reset=True, cudagraph_mode="FULL_AND_PIECEWISE")
    assert sekv["cudagraph_mode"] == warm["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    for w, s in zip(warm["steps"], sekv["steps"]):
        assert s["output_token_ids"] == w["output_token_ids"]
        assert s["num_cached_tokens"] == w["num_cached_tokens"]
    for prev, step in zip(sekv["steps"], sekv["steps"][1:]):
        computed_before = len(prev["prompt_token_ids"]) + len(prev["output_token_ids"]) - 1
        assert step["kv_transfer_params"]["sekv"]["restored_tokens"]["host"] == computed_before // BLOCK_TOKENS * BLOCK_TOKENS


def test_under_an_fp8_kv_cache_outputs_equal_plain_vllm_and_the_history_is_restored(tmp_path, model_dir, essay):
    """`--kv-cache-dtype fp8`: the workspace keeps K/V as the attention layer
    receives them and a restore writes them through the backend's own
    cache-update op, which quantizes them as the original prefill did, so the
    paged cache holds the same bytes vLLM's own prefix cache would."""
    warm = run_session(tmp_path, model_dir, essay, None, reset=False, kv_cache_dtype="fp8")
    sekv = run_session(tmp_path, model_dir, essay, SEKV, reset=True, kv_cache_dtype="fp8")
    assert warm["steps"][2]["num_cached_tokens"] > 0
    for w, s in zip(warm["steps"], sekv["steps"]):
        assert s["output_token_ids"] == w["output_token_ids"]
        assert s["num_cached_tokens"] == w["num_cached_tokens"]
    for step in sekv["steps"][1:]:
        assert step["kv_transfer_params"]["sekv"]["restored_tokens"]["host"] > 0


@pytest.mark.parametrize("restore_mode", ["layerwise", "batched"])
def test_over_an_fp8_kv_cache_an_fp8_workspace_moves_the_caches_bytes(tmp_path, model_dir, essay, restore_mode):
    """`--kv-cache-dtype fp8` with `workspace_codec` fp8: the host tier keeps
    the bytes the paged cache holds (read through byte views of
    FlashAttention's layout), a restore moves them and their parameters and
    writes them back, layerwise through the same views, batched through the
    cache-update op, which maps each e4m3 value to itself: greedy outputs
    equal vLLM's own fp8 prefix cache's."""
    warm = run_session(tmp_path, model_dir, essay, None, reset=False, kv_cache_dtype="fp8")
    sekv = {**SEKV, "restore_mode": restore_mode, "workspace_codec": "fp8"}
    turns = [essay[:3000], "\n\nTool output:\n" + essay[3000:5000], "\n\nTool output:\n" + essay[5000:6500]]
    spec = {"model": model_dir, "sekv": sekv, "turns": turns, "max_tokens": 24, "salt": "tenant-a",
            "other_salt": "tenant-b", "dtype": "bfloat16", "reset": True, "metrics": True, "kv_cache_dtype": "fp8"}
    fp8 = run_runner("session_runner.py", spec, tmp_path, f"sekv-{restore_mode}-fp8-cache-bytes")
    for w, s in zip(warm["steps"], fp8["steps"]):
        assert s["output_token_ids"] == w["output_token_ids"]
        assert s["num_cached_tokens"] == w["num_cached_tokens"]
    m = fp8["metrics"]
    per_token = m["vllm:sekv_restored_bytes"] / m["vllm:sekv_restored_tokens"]
    fp8_per_token = HostPool.bytes_per_block(30, BLOCK_TOKENS, 3, 64, torch.bfloat16, "fp8") / BLOCK_TOKENS
    assert per_token == pytest.approx(fp8_per_token, rel=0.01)


@pytest.mark.parametrize("restore_mode", ["layerwise", "batched"])
def test_an_fp8_workspace_restores_the_history_moving_its_fp8_bytes(tmp_path, runs, model_dir, essay, restore_mode):
    """`workspace_codec` fp8 on CUDA: the same history is restored from the
    fp8 host tier (captures quantized where they are, restores dequantized on
    the device, layer by layer or batched), the restores move the fp8 bytes
    and parameters per token (0.63 of the exact workspace's at 16-token
    blocks), and the greedy continuation starts as the exact workspace's
    (fp8 K/V is lossy: the first 8 tokens of each restored step are
    compared)."""
    _, _, exact, _ = runs
    sekv = {**SEKV, "restore_mode": restore_mode, "workspace_codec": "fp8"}
    turns = [essay[:3000], "\n\nTool output:\n" + essay[3000:5000], "\n\nTool output:\n" + essay[5000:6500]]
    spec = {"model": model_dir, "sekv": sekv, "turns": turns, "max_tokens": 24, "salt": "tenant-a",
            "other_salt": "tenant-b", "dtype": "bfloat16", "reset": True, "metrics": True}
    fp8 = run_runner("session_runner.py", spec, tmp_path, f"sekv-{restore_mode}-fp8-workspace")
    m = fp8["metrics"]
    assert m.get("vllm:sekv_restored_tokens", 0) > 0, m
    per_token = m["vllm:sekv_restored_bytes"] / m["vllm:sekv_restored_tokens"]
    # SmolLM2: 30 layers, 3 KV heads, head_dim 64, bf16; fp8 bytes plus each block's parameters
    # (scale and centres: at 16-token blocks 0.627 of the exact bytes)
    exact_per_token, fp8_per_token = (HostPool.bytes_per_block(30, BLOCK_TOKENS, 3, 64, torch.bfloat16, codec)
                                      / BLOCK_TOKENS for codec in ("exact", "fp8"))
    assert per_token == pytest.approx(fp8_per_token, rel=0.01), (per_token, fp8_per_token / exact_per_token)
    assert fp8["steps"][0]["output_token_ids"] == exact["steps"][0]["output_token_ids"]
    for e, f in zip(exact["steps"][1:], fp8["steps"][1:]):
        assert f["num_cached_tokens"] == e["num_cached_tokens"]
        assert f["output_token_ids"][:8] == e["output_token_ids"][:8]
