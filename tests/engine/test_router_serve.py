"""The SeKV zoom router through a real `vllm serve`: a calibrated router file
(`benchmarks/results/router_smollm2.pt`, written by `vllm-sekv calibrate`)
loads at start-up, and the views' probes rank history blocks with it instead
of the training-free Mean-K scores, which changes what a view selects.

Two servers (SmolLM2, bf16, CPU), each serving one 6K-token passkey prompt
from 2048-token views with surprisal on: one with the router, one scoring the
same surprisal-weighted block means training-free (`wmean_pre`, `max`).
"""
from pathlib import Path

import pytest

from test_http_serve import post
from vllm_sekv.serving import LocalServer

pytestmark = pytest.mark.engine

ROUTER = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "router_smollm2.pt"
VLLM_ARGS = ["--max-model-len", "8192", "--enforce-eager", "--dtype", "bfloat16", "--gpu-memory-utilization", "0.5"]
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "SEKV_HOST_BYTES": "1G"}
VIEW_TOKENS = 2048


def serve_once(model_dir, task, sekv):
    with LocalServer(model_dir, sekv={"surprisal": "on", "view_tokens": VIEW_TOKENS, **sekv},
                     vllm_args=VLLM_ARGS, env=ENV) as server:
        body = {"model": model_dir, "messages": task.messages, "max_tokens": 8, "temperature": 0,
                "continue_final_message": True, "add_generation_prompt": False}
        return post(server.url, "/v1/chat/completions", body)


@pytest.fixture(scope="module")
def replies(model_dir, eval_tasks):
    from transformers import AutoTokenizer

    task = eval_tasks.generate("passkey", 6144, 0, AutoTokenizer.from_pretrained(model_dir))
    routed = serve_once(model_dir, task, {"router_path": str(ROUTER)})
    mean_k = serve_once(model_dir, task, {"index_summary": "wmean_pre", "index_combine": "max"})
    return routed, mean_k


def test_the_router_selects_the_view(replies):
    routed, mean_k = replies
    views = [r["kv_transfer_params"]["sekv"]["view"] for r in replies]
    for view in views:
        assert view["passes"].get("probe") == 1 and view["passes"]["final"] == 1
        assert view["view_tokens"] <= VIEW_TOKENS
    assert views[0]["selected_blocks"] != views[1]["selected_blocks"]
    assert routed["choices"][0]["message"]["content"]  # it answered


def test_a_bad_router_file_stops_the_server_at_start_up(model_dir, tmp_path):
    bad = tmp_path / "router.pt"
    bad.write_bytes(b"not a router")
    server = LocalServer(model_dir, sekv={"surprisal": "on", "router_path": str(bad)}, vllm_args=VLLM_ARGS, env=ENV)
    with pytest.raises(RuntimeError, match="server exited"):
        server.start(timeout_s=300)
    assert "sekv config 'router_path'" in server.log_path.read_text(errors="replace")
