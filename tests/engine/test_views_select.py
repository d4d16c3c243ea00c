"""A limit on a view's selected blocks (`view_select_blocks`) on the real
vLLM engine and SmolLM2, float32.

A 3-step session served from 768-token views: essays, a fact among them, more
essay text, then a question about the fact, each request asking (through
`vllm_xargs`) for at most 2 selected blocks. The final view holds the fact's
block and otherwise continuous history: the sink, then the latest blocks up
to the question.
"""
import pytest

from engine_process import run_runner

pytestmark = pytest.mark.engine

BT = 32
SEKV = {"host_bytes": "512M", "block_tokens": BT, "view_tokens": 768, "sink_tokens": 64, "recent_tokens": 64,
        "rerank_blocks": 64}
FACT = " The locker code of the Zanzibar quarry ledger is 7319. "
QUESTION = "\n\nQuestion: what is the locker code of the Zanzibar quarry ledger?\nAnswer:"


@pytest.fixture(scope="module")
def session(tmp_path_factory, model_dir, essay):
    tmp = tmp_path_factory.mktemp("select")
    turns = [essay[:3000], essay[3000:3600] + FACT + essay[3600:7000], QUESTION]
    spec = {"model": model_dir, "sekv": SEKV, "turns": turns, "max_tokens": 8, "salt": "a", "other_salt": "b",
            "dtype": "float32", "extra_args": {"view_select_blocks": 2}}
    return run_runner("session_runner.py", spec, tmp, "sekv-select")


def test_the_view_selects_two_blocks_and_fills_its_room_with_the_latest_history(session, model_dir):
    from transformers import AutoTokenizer

    last = session["steps"][2]
    view = last["kv_transfer_params"]["sekv"]["view"]
    prompt = last["prompt_token_ids"]
    assert len(prompt) > 2 * SEKV["view_tokens"] and view["passes"]["final"] == 1
    words = AutoTokenizer.from_pretrained(model_dir).encode(FACT, add_special_tokens=False)[1:-1]
    (hit,) = [i for i in range(len(prompt)) if prompt[i : i + len(words)] == words]
    fact = set(range(hit // BT, (hit + len(words) - 1) // BT + 1))
    ranked, selected = view["ranked_blocks"], view["selected_blocks"]
    assert len(ranked) == 2 and fact & set(ranked), "the question did not find the fact"
    sink = list(range(SEKV["sink_tokens"] // BT))
    rest = sorted(set(selected) - set(ranked) - set(sink))
    # the rest of the view is one stretch of the latest history, up to the question
    assert set(range(rest[0], rest[-1] + 1)) <= set(selected) and len(rest) > 10
    assert (len(prompt) - 1) // BT - rest[-1] <= 3
