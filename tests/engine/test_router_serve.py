"""The SeKV zoom router through a real `vllm serve`: a calibrated router file
(`benchmarks/results/router_calibration/router_smollm2.pt`, written by `vllm-sekv calibrate`)
loads at start-up, and the views' probes rank history blocks with it instead
of the training-free Mean-K scores, which changes what a view selects; with
`restore_codec` "router" its tiers also set the rank each selected block
moves at.

Two servers (SmolLM2, float32, CPU), each serving one 6K-token passkey prompt
from 2048-token views with surprisal on: one with the router (and its ranks),
one scoring the same surprisal-weighted block means training-free
(`wmean_pre`, `max`).
"""
from pathlib import Path

import pytest

from test_coarse_serve import counters
from test_http_serve import post
from testbed.serving import LocalServer

pytestmark = pytest.mark.engine

ROUTER = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "router_calibration" / "router_smollm2.pt"
VLLM_ARGS = ["--max-model-len", "8192", "--enforce-eager", "--dtype", "float32", "--gpu-memory-utilization", "0.5"]
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "SEKV_HOST_BYTES": "1G"}
VIEW_TOKENS = 2048


def serve_once(model_dir, task, sekv):
    """(reply, the sekv counters' change over the request)."""
    with LocalServer(model_dir, sekv={"surprisal": "on", "view_tokens": VIEW_TOKENS, **sekv},
                     vllm_args=VLLM_ARGS, env=ENV) as server:
        body = {"model": model_dir, "messages": task.messages, "max_tokens": 8, "temperature": 0,
                "continue_final_message": True, "add_generation_prompt": False}
        before = counters(server.url)
        reply = post(server.url, "/v1/chat/completions", body)
        after = counters(server.url)
        return reply, {k: after[k] - before.get(k, 0.0) for k in after}


@pytest.fixture(scope="module")
def replies(model_dir, eval_tasks):
    from transformers import AutoTokenizer

    task = eval_tasks.generate("passkey", 6144, 0, AutoTokenizer.from_pretrained(model_dir))
    routed = serve_once(model_dir, task, {"router_path": str(ROUTER), "restore_codec": "router"})
    mean_k = serve_once(model_dir, task, {"index_summary": "wmean_pre", "index_combine": "max"})
    return routed, mean_k


def test_the_router_selects_the_view(replies):
    (routed, _), _ = replies
    views = [r["kv_transfer_params"]["sekv"]["view"] for r, _ in replies]
    for view in views:
        assert view["passes"].get("probe") == 1 and view["passes"]["final"] == 1
        assert view["view_tokens"] <= VIEW_TOKENS
    assert views[0]["selected_blocks"] != views[1]["selected_blocks"]
    assert routed["choices"][0]["message"]["content"]  # it answered


def test_the_routers_tiers_set_the_rank_each_selected_block_moves_at(replies, model_dir):
    import json

    from vllm_sekv.index.router import ZoomRouter

    (routed, delta), (mean_k, _) = replies
    view = routed["kv_transfer_params"]["sekv"]["view"]
    levels = ZoomRouter.load(str(ROUTER)).rank_levels[1:]  # 8, 16, full
    ranks = view["block_ranks"]
    assert set(ranks) <= {str(r) for r in levels if r > 0} | {"exact"}
    assert sum(ranks.values()) == len(view["selected_blocks"])
    lossy = sum(n for r, n in ranks.items() if r != "exact")
    assert lossy > 0 and ranks["exact"] >= 3  # sink and recent blocks always move exact
    assert "block_ranks" not in mean_k["kv_transfer_params"]["sekv"]["view"]  # exact codec
    # The factors moved fewer bytes than the restored rows' exact KV.
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    row_bytes = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * (
        cfg["hidden_size"] // cfg["num_attention_heads"]) * 4  # K and V, float32
    restored = delta["vllm:sekv_restored_tokens_total"]
    assert 0 < delta["vllm:sekv_restored_bytes_total"] < restored * row_bytes


def test_a_bad_router_file_stops_the_server_at_start_up(model_dir, tmp_path):
    bad = tmp_path / "router.pt"
    bad.write_bytes(b"not a router")
    server = LocalServer(model_dir, sekv={"surprisal": "on", "router_path": str(bad)}, vllm_args=VLLM_ARGS, env=ENV)
    with pytest.raises(RuntimeError, match="server exited"):
        server.start(timeout_s=300)
    assert "sekv config 'router_path'" in server.log_path.read_text(errors="replace")
