"""Views whose selection is re-ranked on actual keys, with BM25's best blocks
among the re-rank's candidates (`rerank_blocks`, `lexical_candidates`), on
the real vLLM engine and SmolLM2, float32.

A 3-step session served from 384-token views: an essay, a second essay
passage with one planted fact in its middle, then more essay and a question
about that fact in words no other block holds. The index scores with the
queries of the question's last token only (`probe_query_tokens` 1), which
on this session leave the fact's block out of the view. The re-rank scores
the index's single best candidate and the two blocks BM25 ranks best against
the question's block, and a view takes every re-ranked block ahead of the
rest: the block that holds the fact's rare words must be in the final view.
"""
import numpy as np
import pytest

from engine_process import run_runner
from vllm_sekv.index import lexical

pytestmark = pytest.mark.engine

BT = 32
SEKV = {"host_bytes": "512M", "block_tokens": BT, "view_tokens": 384, "sink_tokens": 64, "recent_tokens": 64,
        "rerank_blocks": 1, "lexical_candidates": 2, "probe_query_tokens": 1}
FACT = " The vault code of the Zanzibar quarry ledger is 7319. "
QUESTION = "\n\nQuestion: what is the vault code of the Zanzibar quarry ledger?\nAnswer:"


@pytest.fixture(scope="module")
def session(tmp_path_factory, model_dir, essay):
    tmp = tmp_path_factory.mktemp("rerank-lexical")
    turns = [essay[:3000], "\n\nTool output:\n" + essay[3000:4000] + FACT + essay[4000:5000],
             "\n\nTool output:\n" + essay[5000:6500] + QUESTION]
    spec = {"model": model_dir, "sekv": SEKV, "turns": turns, "max_tokens": 8, "salt": "a",
            "other_salt": "b", "dtype": "float32"}
    return run_runner("session_runner.py", spec, tmp, "sekv-rerank-lexical")


def test_the_block_holding_the_questions_rare_words_is_in_the_view(session, model_dir):
    from transformers import AutoTokenizer

    last = session["steps"][2]
    view = last["kv_transfer_params"]["sekv"]["view"]
    prompt = last["prompt_token_ids"]
    assert len(prompt) > 3 * SEKV["view_tokens"]
    assert view["passes"]["probe"] == view["passes"]["final"] == 1  # after ingesting the essay before the question
    words = AutoTokenizer.from_pretrained(model_dir).encode(" Zanzibar quarry ledger", add_special_tokens=False)
    hits = [i for i in range(len(prompt)) if prompt[i : i + len(words)] == words]
    assert len(hits) == 2  # the fact, then the question (in the step's new tokens)
    fact_blocks = {hits[0] // BT, (hits[0] + len(words) - 1) // BT}
    scores = lexical.block_scores(np.asarray(prompt[: hits[1] // BT * BT]), prompt[hits[1]:], BT)
    assert int(np.argmax(scores)) in fact_blocks  # BM25's best for the question holds the fact's words
    assert fact_blocks & set(view["selected_blocks"])
    selected = len(view["selected_blocks"]) - (SEKV["sink_tokens"] + SEKV["recent_tokens"]) // BT
    assert selected >= 3  # room for every re-ranked block
