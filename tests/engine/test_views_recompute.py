"""Views that recompute their selected history (`recompute_blocks`), on the
real vLLM engine and SmolLM2, float32.

A 3-step session served from 384-token views with every selected block
recomputed, in both layouts: "in_order" (the default) with a recent window
(recomputed too), set in the server's config, and "after_recent" with no
recent window, asked for by each request (`vllm_xargs`). Either way the final view is the sink
(restored: the first tokens' KV does not depend on what follows them) + the
rest of the history and the new tokens, computed in the view in virtual
order. Its greedy output must be plain vLLM's on exactly that token sequence,
and the report must say what was recomputed.
"""
import pytest

from engine_process import run_runner

pytestmark = pytest.mark.engine

BT = 32
SEKV = {"host_bytes": "512M", "block_tokens": BT, "view_tokens": 384, "sink_tokens": 64}
LAYOUTS = {  # layout -> (server config, request's own parameters)
    "in_order": ({"recent_tokens": 64, "recompute_blocks": 1000}, None),
    "after_recent": ({"recent_tokens": 0}, {"recompute_blocks": 1000, "recompute_layout": "after_recent"}),
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def session(request, tmp_path_factory, model_dir, essay):
    tmp = tmp_path_factory.mktemp(f"recompute-{request.param}")
    turns = [essay[:3000], "\n\nTool output:\n" + essay[3000:5000], "\n\nTool output:\n" + essay[5000:6500]]
    config, extra_args = LAYOUTS[request.param]
    spec = {"model": model_dir, "sekv": {**SEKV, **config}, "turns": turns, "max_tokens": 16, "salt": "a",
            "other_salt": "b", "dtype": "float32", "extra_args": extra_args}
    return tmp, run_runner("session_runner.py", spec, tmp, "sekv-recompute")


def test_a_recomputed_view_answers_as_plain_vllm_on_the_views_tokens(session, model_dir):
    tmp, out = session
    last = out["steps"][2]
    view = last["kv_transfer_params"]["sekv"]["view"]
    prompt = last["prompt_token_ids"]
    assert len(prompt) > 3 * SEKV["view_tokens"] and view["passes"]["final"] == 1
    blocks = view["selected_blocks"]  # restored (the sink), then recomputed
    sink = SEKV["sink_tokens"] // BT
    assert blocks[:sink] == list(range(sink)) and view["recomputed_blocks"] == len(blocks) - sink > 0
    assert blocks[sink:] == sorted(blocks[sink:])
    tail = view["view_tokens"] - len(blocks) * BT
    ids = [t for b in blocks for t in prompt[b * BT : (b + 1) * BT]] + prompt[len(prompt) - tail :]
    assert len(ids) == view["view_tokens"] <= SEKV["view_tokens"]
    plain = run_runner("session_runner.py", {"model": model_dir, "sekv": None, "prompt_ids": ids, "max_tokens": 16,
                                             "salt": "a", "other_salt": "b", "dtype": "float32"}, tmp, "plain-view")
    assert plain["steps"][0]["output_token_ids"] == last["output_token_ids"]


def test_the_final_view_restores_only_the_sink_and_counts_recomputed_history_as_prefilled(session):
    _, out = session
    sekv = out["steps"][2]["kv_transfer_params"]["sekv"]
    assert sekv["restored_tokens"] == {"host": SEKV["sink_tokens"]}  # the final pass's restore
    assert sekv["prefilled_tokens"] >= sekv["view"]["recomputed_blocks"] * BT
