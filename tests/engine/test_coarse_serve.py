"""SeKV coarse summaries and lowrank restores through a real `vllm serve`.

One server (SmolLM2, float32, CPU) with surprisal, coarse attention and
`restore_codec` lowrank(8) on serves one 6K-token passkey prompt from
2048-token views twice: with summaries (the server's setting) and with the
request opting out (`kv_transfer_params {"coarse": false}`), whose view then
gives the summaries' room to history blocks. That the merge is right is
tests/worker_side/test_coarse_attention.py's job (against exact attention); here it must
run inside the engine, on every layer of every token the view computes.
"""
import urllib.request

import pytest

from test_http_serve import post
from testbed.serving import LocalServer

pytestmark = pytest.mark.engine

VLLM_ARGS = ["--max-model-len", "8192", "--enforce-eager", "--dtype", "float32", "--gpu-memory-utilization", "0.5"]
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "SEKV_HOST_BYTES": "1G"}
VIEW_TOKENS = 2048
SEKV = {"surprisal": "on", "coarse": "on", "coarse_percent": 10, "restore_codec": "lowrank(8)",
        "view_tokens": VIEW_TOKENS}


def counters(url):
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("vllm:sekv_") and "_total" in line:
            name = line.split("{")[0].split(" ")[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


@pytest.fixture(scope="module")
def served(model_dir, eval_tasks):
    """(reply with summaries, reply without, counter changes over each)."""
    from transformers import AutoTokenizer

    task = eval_tasks.generate("passkey", 6144, 0, AutoTokenizer.from_pretrained(model_dir))
    body = {"model": model_dir, "messages": task.messages, "max_tokens": 6, "temperature": 0,
            "continue_final_message": True, "add_generation_prompt": False}
    replies, deltas = [], []
    with LocalServer(model_dir, sekv=SEKV, vllm_args=VLLM_ARGS, env=ENV) as server:
        for extra in ({}, {"kv_transfer_params": {"coarse": False}}):
            before = counters(server.url)
            replies.append(post(server.url, "/v1/chat/completions", {**body, **extra}))
            after = counters(server.url)
            deltas.append({k: after.get(k, 0.0) - before.get(k, 0.0) for k in after})
    return replies, deltas


def test_a_view_carries_summaries_of_the_history_it_leaves_out(served):
    (coarse, _), (delta, _) = served
    view = coarse["kv_transfer_params"]["sekv"]["view"]
    assert view["passes"]["final"] == 1
    assert 0 < view["summaries"] <= VIEW_TOKENS * SEKV["coarse_percent"] // 100
    # Summaries stand for the rest of the history (anchors aside), and take
    # room in the budget: view tokens + summaries fit it (equal device memory).
    assert view["summary_tokens"] > view["prompt_tokens"] - view["view_tokens"] - 200
    assert view["view_tokens"] + view["summaries"] <= VIEW_TOKENS
    assert delta["vllm:sekv_summaries_total"] == view["summaries"]
    assert delta["vllm:sekv_summary_bytes_total"] > 0
    assert coarse["choices"][0]["message"]["content"]


def test_the_merge_runs_on_every_layer_of_every_token_the_view_computes(served, model_dir):
    import json
    from pathlib import Path

    (coarse, _), (delta, _) = served
    layers = json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"]
    view = coarse["kv_transfer_params"]["sekv"]["view"]
    history = len(view["selected_blocks"]) * view["block_tokens"] + view.get("anchor_tokens", 0)
    computed = view["view_tokens"] - history + coarse["usage"]["completion_tokens"] - 1
    assert delta["vllm:sekv_coarse_rows_total"] == computed * layers


def test_a_request_can_opt_out_and_its_view_takes_more_history(served):
    (coarse, plain), (_, delta) = served
    v1, v2 = (r["kv_transfer_params"]["sekv"]["view"] for r in (coarse, plain))
    assert "summaries" not in v2 and delta.get("vllm:sekv_coarse_rows_total", 0) == 0
    assert len(v2["selected_blocks"]) > len(v1["selected_blocks"])


def test_lowrank_restores_move_fewer_bytes_than_exact_ones(served, model_dir):
    import json
    from pathlib import Path

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    row_bytes = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * (
        cfg["hidden_size"] // cfg["num_attention_heads"]) * 4  # K and V, float32
    _, (delta, _) = served
    restored = delta["vllm:sekv_restored_tokens_total"]
    assert restored > 0
    assert 0 < delta["vllm:sekv_restored_bytes_total"] < restored * row_bytes
