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
The same session again with the re-rank combining only the model's retrieval
heads (`rerank_heads_path`, a file `vllm-sekv calibrate-heads` writes here),
a heads file measured on another model stopping the server at start-up, and
the session under `view_preset` accurate, each key it sets taking effect.
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


def _serve(tmp_path_factory, model_dir, essay, sekv, name):
    tmp = tmp_path_factory.mktemp(name)
    turns = [essay[:3000], "\n\nTool output:\n" + essay[3000:4000] + FACT + essay[4000:5000],
             "\n\nTool output:\n" + essay[5000:6500] + QUESTION]
    spec = {"model": model_dir, "sekv": sekv, "turns": turns, "max_tokens": 8, "salt": "a",
            "other_salt": "b", "dtype": "float32"}
    return run_runner("session_runner.py", spec, tmp, name)


@pytest.fixture(scope="module")
def session(tmp_path_factory, model_dir, essay):
    return _serve(tmp_path_factory, model_dir, essay, SEKV, "sekv-rerank-lexical")


@pytest.fixture(scope="module")
def heads_file(tmp_path_factory, model_dir):
    from vllm_sekv.cli import main

    path = str(tmp_path_factory.mktemp("heads") / "smollm2_heads.json")
    assert main(["calibrate-heads", model_dir, "--out", path, "--texts", "2", "--tokens", "512"]) == 0
    return path


@pytest.fixture(scope="module")
def session_with_heads(tmp_path_factory, model_dir, essay, heads_file):
    return _serve(tmp_path_factory, model_dir, essay, {**SEKV, "rerank_heads_path": heads_file},
                  "sekv-rerank-heads")


@pytest.mark.parametrize("served", ["session", "session_with_heads"])
def test_the_block_holding_the_questions_rare_words_is_in_the_view(served, request, model_dir):
    from transformers import AutoTokenizer

    last = request.getfixturevalue(served)["steps"][2]
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


def test_a_heads_file_of_another_model_stops_the_server_at_start_up(model_dir, heads_file, tmp_path):
    """The file is read when the config is (a malformed one fails there); its
    model fingerprint is checked by the worker against the served model."""
    import dataclasses

    from testbed.serving import LocalServer
    from vllm_sekv.index.retrieval_heads import RetrievalHeads, read_heads_file

    found = read_heads_file(heads_file)
    geometry = dataclasses.replace(found.geometry, num_layers=found.geometry.num_layers + 2)
    other = tmp_path / "other_heads.json"
    RetrievalHeads(geometry, found.heads, found.share, found.calibration).write(str(other))
    server = LocalServer(model_dir, sekv={**SEKV, "rerank_heads_path": str(other)},
                         vllm_args=["--max-model-len", "2048", "--enforce-eager", "--dtype", "float32"],
                         env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    with pytest.raises(RuntimeError, match="server exited"):
        server.start(timeout_s=300)
    log = server.log_path.read_text(errors="replace")
    assert "sekv config 'rerank_heads_path'" in log and "calibrated on another model" in log


@pytest.fixture(scope="module")
def session_with_preset(tmp_path_factory, model_dir, essay, heads_file):
    """The session under `view_preset` accurate with the heads; SEKV's own
    re-rank keys (one candidate, two lexical ones) keep their values."""
    return _serve(tmp_path_factory, model_dir, essay,
                  {**SEKV, "view_preset": "accurate", "rerank_heads_path": heads_file}, "sekv-view-preset")


def test_the_accurate_preset_serves_views_with_every_key_it_sets(session_with_preset):
    last = session_with_preset["steps"][2]
    view = last["kv_transfer_params"]["sekv"]["view"]
    prompt = last["prompt_token_ids"]
    assert view["passes"]["probe"] == 3 and view["passes"]["final"] == 1  # probe_hops
    assert view["lexical_hop_ranked"]  # probe_lexical_hop
    assert "lookalike_blocks" in view  # view_lookalikes drop (none stands out of a history this short)
    sink = SEKV["sink_tokens"] // BT
    assert view["recomputed_blocks"] == len(view["selected_blocks"]) - sink > 0  # every selected block, in order
    assert len(prompt) > 3 * SEKV["view_tokens"] and view["view_tokens"] <= SEKV["view_tokens"]
