"""Probe hops (`probe_hops` 2) on the real vLLM engine and SmolLM2, float32.

A 4-step session served from 384-token views: an essay, a tool output
naming who keeps a ledger, another naming that person's locker combination,
then a question that names the ledger and asks for the combination. The
step probes, probes again behind the view its first probe chose, and its
final view must hold both facts; the request asks for its hops
(`kv_transfer_params` through `vllm_xargs`), on a server whose default is one.
"""
import pytest

from engine_process import run_runner

pytestmark = pytest.mark.engine

BT = 32
SEKV = {"host_bytes": "512M", "block_tokens": BT, "view_tokens": 384, "sink_tokens": 64, "recent_tokens": 64,
        "rerank_blocks": 64}
KEEPER = " The Zanzibar quarry ledger is kept by the warden Okonkwo Adebayo. "
LOCKER = " Okonkwo Adebayo's locker combination is 7319. "
QUESTION = "\n\nQuestion: what is the locker combination of the warden who keeps the Zanzibar quarry ledger?\nAnswer:"


def turns(essay: str) -> list[str]:
    """The session's four turns: an essay, the keeper's tool output, the locker's, the question."""
    return [essay[:3000], "\n\nTool output:\n" + essay[3000:4000] + KEEPER + essay[4000:5000],
            "\n\nTool output:\n" + essay[5000:6000] + LOCKER + essay[6000:7000],
            "\n\nTool output:\n" + essay[7000:8000] + QUESTION]


@pytest.fixture(scope="module")
def session(tmp_path_factory, model_dir, essay):
    tmp = tmp_path_factory.mktemp("probe-hops")
    spec = {"model": model_dir, "sekv": SEKV, "turns": turns(essay), "max_tokens": 8, "salt": "a",
            "other_salt": "b", "dtype": "float32", "extra_args": {"probe_hops": 2}}
    return run_runner("session_runner.py", spec, tmp, "sekv-probe-hops")


def fact_blocks(model_dir, prompt: list[int], text: str) -> set[int]:
    from transformers import AutoTokenizer

    words = AutoTokenizer.from_pretrained(model_dir).encode(text, add_special_tokens=False)[1:-1]
    (hit,) = [i for i in range(len(prompt)) if prompt[i : i + len(words)] == words]
    return set(range(hit // BT, (hit + len(words) - 1) // BT + 1))


def test_a_second_probe_runs_behind_the_first_ones_view_and_the_final_view_holds_both_facts(session, model_dir):
    last = session["steps"][3]
    view = last["kv_transfer_params"]["sekv"]["view"]
    prompt = last["prompt_token_ids"]
    assert len(prompt) > 4 * SEKV["view_tokens"]
    assert [kind for kind, *_ in view["pass_seconds"]] == ["ingest", "probe", "probe", "final"]
    selected = set(view["selected_blocks"])
    assert fact_blocks(model_dir, prompt, KEEPER) & selected
    assert fact_blocks(model_dir, prompt, LOCKER) & selected


@pytest.fixture(scope="module")
def lexical_session(tmp_path_factory, model_dir, essay):
    """The same session, one probe and a lexical hop (`probe_lexical_hop`), the view selecting 2 blocks."""
    tmp = tmp_path_factory.mktemp("lexical-hop")
    spec = {"model": model_dir, "sekv": {**SEKV, "probe_lexical_hop": "on"}, "turns": turns(essay), "max_tokens": 8,
            "salt": "a", "other_salt": "b", "dtype": "float32", "extra_args": {"view_select_blocks": 2}}
    return run_runner("session_runner.py", spec, tmp, "sekv-lexical-hop")


def test_a_lexical_hop_leads_from_the_first_probes_best_block_to_the_fact_it_names(lexical_session, model_dir):
    last = lexical_session["steps"][3]
    view = last["kv_transfer_params"]["sekv"]["view"]
    prompt = last["prompt_token_ids"]
    assert [kind for kind, *_ in view["pass_seconds"]] == ["ingest", "probe", "final"]
    keeper, locker = fact_blocks(model_dir, prompt, KEEPER), fact_blocks(model_dir, prompt, LOCKER)
    first, hop = view["ranked_blocks"]  # the probe's best, then the hop's best
    assert first in keeper  # the question names the ledger
    assert hop in locker and view["lexical_hop_ranked"][0] == hop  # the keeper's name leads to the locker
    assert not keeper & locker
