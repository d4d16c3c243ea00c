"""Qwen2.5-Coder-1.5B-Instruct, the evaluation's model, inside real vLLM on
CUDA (run on the GPU machine by benchmarks/gpu/device/device.sh; skipped without
CUDA or without the model's parts).

New to the plugin in this model: QKV bias, RoPE theta 1e6, head_dim 128,
2 KV heads for 12 query heads. The same 3-step session as
test_cuda_engine.py in bf16: a restore after vLLM's prefix cache was reset
gives plain vLLM's greedy tokens and computes only the new ones; and through
`vllm serve`, a chat session whose every step fits its view budget (the view
holds the whole history) answers exactly as a plain server does.
"""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from engine_process import run_runner  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.engine,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BLOCK_TOKENS = 16  # vLLM's page size on CUDA: sekv restores exactly what its prefix cache would hold
SEKV = {"host_bytes": "4G", "block_tokens": BLOCK_TOKENS, "restore_mode": "layerwise"}
VLLM_ARGS = ["--max-model-len", "8192", "--dtype", "bfloat16", "--gpu-memory-utilization", "0.3",
             "--enforce-eager", "--enable-prompt-tokens-details"]
ENV = {"VLLM_SERVER_DEV_MODE": "1", "SEKV_HOST_BYTES": "4G", "SEKV_BLOCK_TOKENS": str(BLOCK_TOKENS)}


@pytest.fixture(scope="module")
def qwen_dir():
    from vllm_sekv.models import ModelPackageMissing, prepare_model

    try:
        return str(prepare_model("qwen2.5-coder-1.5b", quiet=True))
    except ModelPackageMissing as e:
        pytest.skip(str(e))


def _session(tmp_path, model, essay, sekv, reset):
    turns = [essay[:4000], "\n\nTool output:\n" + essay[4000:7000], "\n\nTool output:\n" + essay[7000:9000]]
    spec = {"model": model, "sekv": sekv, "turns": turns, "max_tokens": 24, "salt": "tenant-a",
            "other_salt": "tenant-b", "dtype": "bfloat16", "reset": reset}
    return run_runner("session_runner.py", spec, tmp_path, f"qwen-{'sekv' if sekv else 'plain'}-{reset}")


def test_restores_give_plain_vllms_greedy_tokens_and_compute_only_new_ones(tmp_path, qwen_dir, essay):
    warm = _session(tmp_path, qwen_dir, essay, None, reset=False)
    sekv = _session(tmp_path, qwen_dir, essay, SEKV, reset=True)
    assert warm["steps"][2]["num_cached_tokens"] > 0  # vLLM's own cache served the history
    for w, s in zip(warm["steps"], sekv["steps"]):
        assert s["prompt_token_ids"] == w["prompt_token_ids"]
        assert s["output_token_ids"] == w["output_token_ids"]
        assert s["num_cached_tokens"] == w["num_cached_tokens"]
    for prev, step in zip(sekv["steps"], sekv["steps"][1:]):
        computed_before = len(prev["prompt_token_ids"]) + len(prev["output_token_ids"]) - 1
        restorable = computed_before // BLOCK_TOKENS * BLOCK_TOKENS
        assert step["kv_transfer_params"]["sekv"]["restored_tokens"]["host"] == restorable
    assert sekv["probe"]["other_salt"]["num_cached_tokens"] == 0  # tenants never share blocks


def test_a_view_holding_the_whole_history_answers_as_plain_vllm(qwen_dir, essay):
    from test_http_serve import chat_session

    from testbed.serving import LocalServer

    with LocalServer(qwen_dir, sekv={}, vllm_args=VLLM_ARGS, env=ENV) as server:
        sekv = chat_session(server.url, qwen_dir, essay, {"kv_transfer_params": {"view_tokens": 8192}})
    with LocalServer(qwen_dir, sekv=None, vllm_args=VLLM_ARGS, env=ENV) as server:
        plain = chat_session(server.url, qwen_dir, essay)
    for p, s in zip(plain, sekv):
        assert s["choices"][0]["message"]["content"] == p["choices"][0]["message"]["content"]
        assert "view" not in s["kv_transfer_params"]["sekv"]  # the whole history, no selection
    for prev, step in zip(sekv, sekv[1:]):
        restored = step["kv_transfer_params"]["sekv"]["restored_tokens"]["host"]
        assert restored >= prev["usage"]["prompt_tokens"] // BLOCK_TOKENS * BLOCK_TOKENS
        assert step["usage"]["prompt_tokens_details"]["cached_tokens"] == restored
