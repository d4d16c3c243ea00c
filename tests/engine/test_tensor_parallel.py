"""sekv with vLLM's tensor parallelism, on the CPU backend (two ranks on this
machine's two cores): a tiny Llama with 4 KV heads (random weights, float32),
each rank holding two of them.

* Restores from the NVMe tier after vLLM's prefix cache was reset give the
  greedy tokens of plain vLLM with the same parallelism, and compute only
  the new tokens (each rank restores its own heads).
* A block missing on one rank (its records deleted) is a miss for both:
  recomputed, never half-restored.
* A view's selection with two ranks equals the selection with one: each
  rank scores with its query heads, the scheduler side combines them.
"""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_process import run_runner  # noqa: E402

pytestmark = pytest.mark.engine

BLOCK_TOKENS = 32


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, model_dir):
    """4 layers, 8 query and 4 KV heads of 32 dims; SmolLM2's tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama")
    tok = AutoTokenizer.from_pretrained(model_dir)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=4096,
                         tie_word_embeddings=True, initializer_range=0.2)  # outputs that depend on the context
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp")
    nvme = tmp / "nvme"
    # 64 blocks of host tier (each 64 KiB per rank): a view's 1760-token history fits, the fillers push it out
    sekv = {"host_bytes": "8M", "block_tokens": BLOCK_TOKENS, "nvme_dir": str(nvme), "nvme_bytes": "64M"}
    two = run_runner("tp_runner.py", {"model": tiny_model, "tp": 2, "sekv": sekv,
                                      "phases": ["session", "lost_rank", "view"]}, tmp, "sekv-tp2", timeout_s=1800)
    plain = run_runner("tp_runner.py", {"model": tiny_model, "tp": 2, "sekv": None,
                                        "phases": ["session", "lost_rank"]}, tmp, "plain-tp2", timeout_s=1800)
    one = run_runner("tp_runner.py", {"model": tiny_model, "tp": 1, "sekv": {"host_bytes": "64M"},
                                      "phases": ["view"]}, tmp, "sekv-tp1", timeout_s=1800)
    return two, plain, one


def test_restores_with_two_ranks_equal_plain_vllm_and_compute_only_new_tokens(runs):
    two, plain, _ = runs
    for s, p in zip(two["session"], plain["session"]):
        assert s["prompt_token_ids"] == p["prompt_token_ids"]
        assert s["output_token_ids"] == p["output_token_ids"]
    assert len(set(p["output_token_ids"][0] for p in plain["session"])) > 1  # outputs that depend on the context
    for prev, step in zip(two["session"], two["session"][1:]):
        computed_before = len(prev["prompt_token_ids"]) + len(prev["output_token_ids"]) - 1
        restored = step["kv_transfer_params"]["sekv"]["restored_tokens"]
        assert restored["host"] == computed_before // BLOCK_TOKENS * BLOCK_TOKENS


def test_a_block_missing_on_one_rank_is_recomputed_on_both(runs):
    two, plain, _ = runs
    lost = two["lost_rank"]
    want = plain["lost_rank"]["step"]["output_token_ids"]
    # with both ranks' records on disk, the history comes back from it
    assert lost["control"]["kv_transfer_params"]["sekv"]["restored_tokens"]["nvme"] > 0
    assert lost["control"]["output_token_ids"] == want
    assert lost["deleted"] > 0
    assert lost["step"]["output_token_ids"] == want
    restored = lost["step"]["kv_transfer_params"]["sekv"]["restored_tokens"]
    assert restored["nvme"] == 0  # rank 0's intact records were not used alone


def test_a_views_selection_with_two_ranks_equals_the_one_with_one(runs):
    two, _, one = runs
    v2, v1 = two["view"]["kv_transfer_params"]["sekv"]["view"], one["view"]["kv_transfer_params"]["sekv"]["view"]
    assert v2["passes"] == v1["passes"] and v1["passes"]["probe"] == 1 and v1["passes"]["final"] == 1
    assert v2["selected_blocks"] == v1["selected_blocks"]
    assert two["view"]["output_token_ids"] == one["view"]["output_token_ids"]
