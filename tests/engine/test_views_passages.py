"""Passages (`view_passage_blocks`) on the real vLLM engine and SmolLM2, float32.

A 3-step session served from 768-token views: essays, then a tool output of
documents separated by blank lines, one of which holds a fact between two
stretches of essay text, and more essay text, then a question about the fact. The server takes
passages (its tokenizer's break tokens found at start-up): the final view
holds the fact's whole document, not only the blocks the question scores.
"""
import pytest

from engine_process import run_runner

pytestmark = pytest.mark.engine

BT = 32
SEKV = {"host_bytes": "512M", "block_tokens": BT, "view_tokens": 768, "sink_tokens": 64, "recent_tokens": 64,
        "rerank_blocks": 64, "view_passage_blocks": 8}
FACT = " The locker code of the Zanzibar quarry ledger is 7319. "
QUESTION = "\n\nQuestion: what is the locker code of the Zanzibar quarry ledger?\nAnswer:"


@pytest.fixture(scope="module")
def session(tmp_path_factory, model_dir, essay):
    tmp = tmp_path_factory.mktemp("passages")
    documents = [essay[3000:3500], essay[3500:3800] + FACT + essay[3800:4100], essay[4100:4600]]
    turns = [essay[:3000], "\n\nTool output:\n" + "\n\n".join(documents) + "\n\n" + essay[5000:7000],
             QUESTION]
    spec = {"model": model_dir, "sekv": SEKV, "turns": turns, "max_tokens": 8, "salt": "a", "other_salt": "b",
            "dtype": "float32"}
    return run_runner("session_runner.py", spec, tmp, "sekv-passages")


def test_the_final_view_holds_the_facts_whole_document(session, model_dir):
    import numpy as np
    from transformers import AutoTokenizer

    from vllm_sekv.workspace.passages import Passages, break_token_ids

    last = session["steps"][2]
    view = last["kv_transfer_params"]["sekv"]["view"]
    prompt = last["prompt_token_ids"]
    assert len(prompt) > 2 * SEKV["view_tokens"] and view["passes"]["final"] == 1
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    words = tokenizer.encode(FACT, add_special_tokens=False)[1:-1]
    (hit,) = [i for i in range(len(prompt)) if prompt[i : i + len(words)] == words]
    fact = set(range(hit // BT, (hit + len(words) - 1) // BT + 1))
    selected = set(view["selected_blocks"])
    assert fact & selected, "the question did not find the fact"
    passages = Passages(np.asarray(prompt), break_token_ids(tokenizer), BT)
    first, last_block = passages.span(min(fact))
    assert 4 <= last_block - first + 1 <= 8  # the document (650 characters) fits view_passage_blocks
    assert set(range(first, last_block + 1)) <= selected
