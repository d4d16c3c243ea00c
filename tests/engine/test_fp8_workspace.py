"""End to end on the real vLLM engine and SmolLM2 (bf16) with `workspace_codec:
fp8`: the same 3-step session as `test_restore_offline`, run once with the
exact workspace and once with the fp8 one, both sending the same prompts (a
step's outputs are not fed back into the next prompt, so a drift in one step
does not change the next step's question). The fp8 session restores the same
history from its host tier (same tokens restored, vLLM's prefix cache reset
before every step), moves about half the bytes host->device, and its greedy
continuation is the exact workspace's. Checked on the first 8 tokens of each
restored step: fp8 K/V is lossy, so longer continuations may drift."""
import pytest

from engine_process import run_runner

pytestmark = pytest.mark.engine

BLOCK_TOKENS = 32
SAME_FIRST_TOKENS = 8  # greedy tokens of each step that must equal the exact workspace's


def run_session(tmp_path, model_dir, essay, codec):
    turns = [essay[:3000], "\n\nTool output:\n" + essay[3000:5000], "\n\nTool output:\n" + essay[5000:6500]]
    sekv = {"host_bytes": "512M", "block_tokens": BLOCK_TOKENS, "workspace_codec": codec}
    spec = {"model": model_dir, "sekv": sekv, "turns": turns, "max_tokens": 24, "salt": "tenant-a",
            "other_salt": "tenant-b", "dtype": "bfloat16", "reset": True, "metrics": True, "feed_outputs": False}
    return run_runner("session_runner.py", spec, tmp_path, f"sekv-bf16-{codec}")


@pytest.fixture(scope="module")
def sessions(tmp_path_factory, model_dir, essay):
    tmp = tmp_path_factory.mktemp("fp8")
    return run_session(tmp, model_dir, essay, "exact"), run_session(tmp, model_dir, essay, "fp8")


def test_fp8_restores_the_same_history_from_the_host_tier(sessions):
    exact, fp8 = sessions
    for e, f in zip(exact["steps"][1:], fp8["steps"][1:]):
        assert f["prompt_token_ids"] == e["prompt_token_ids"]
        restored = f["kv_transfer_params"]["sekv"]["restored_tokens"]["host"]
        assert restored > 0 and f["num_cached_tokens"] == restored
        computed_before = len(f["prompt_token_ids"]) - f["kv_transfer_params"]["sekv"]["prefilled_tokens"]
        assert computed_before == restored


def test_fp8_moves_the_fp8_bytes_and_parameters_per_restored_token(sessions):
    exact, fp8 = sessions
    per_token = []
    for run in (exact, fp8):
        m = run["metrics"]
        assert m.get("vllm:sekv_restored_tokens", 0) > 0, m
        per_token.append(m["vllm:sekv_restored_bytes"] / m["vllm:sekv_restored_tokens"])
    # fp8 bytes + per block a scale and head_dim centres (SmolLM2: head_dim 64, 32-token blocks: 0.5635)
    assert 0.56 <= per_token[1] / per_token[0] < 0.57, per_token


def test_fp8_greedy_continuation_starts_as_the_exact_workspaces(sessions):
    exact, fp8 = sessions
    assert exact["steps"][0]["output_token_ids"] == fp8["steps"][0]["output_token_ids"]  # nothing restored yet
    for e, f in zip(exact["steps"][1:], fp8["steps"][1:]):
        assert f["output_token_ids"][:SAME_FIRST_TOKENS] == e["output_token_ids"][:SAME_FIRST_TOKENS]


def test_fp8_blocks_come_back_from_nvme_after_a_restart_and_never_to_an_exact_server(tmp_path, model_dir, essay):
    """A first engine with fp8 and an NVMe tier writes its blocks behind; a
    second fp8 engine on the same folder restores the session's first prompt
    from NVMe (records with their parameters, checksums verified) and
    continues token for token as the first engine's own restore of that prompt
    from its host tier; an exact engine on the same folder finds none of them
    (the codec is part of the model folder's fingerprint and of each record)."""
    nvme = tmp_path / "nvme"

    def run(codec, name):
        sekv = {"host_bytes": "512M", "block_tokens": BLOCK_TOKENS, "workspace_codec": codec,
                "nvme_dir": str(nvme), "nvme_bytes": "1G"}
        spec = {"model": model_dir, "sekv": sekv, "turns": [essay[:3000]], "max_tokens": 16, "salt": "tenant-a",
                "other_salt": "tenant-b", "dtype": "bfloat16", "reset": True}
        return run_runner("session_runner.py", spec, tmp_path, name)

    first = run("fp8", "fp8-first-life")
    assert first["steps"][0]["kv_transfer_params"]["sekv"]["restored_tokens"]["host"] == 0
    second = run("fp8", "fp8-second-life")
    step = second["steps"][0]
    restored = step["kv_transfer_params"]["sekv"]["restored_tokens"]
    assert restored.get("nvme", 0) > 0 and step["num_cached_tokens"] == sum(restored.values()), restored
    # The first life's own fp8 restore of the same prompt (from its host tier) is the reference: the NVMe
    # records hold the same fp8 bytes and parameters, so the same KV and the same greedy tokens, all of them.
    from_host = first["probe"]["same_salt"]
    assert from_host["kv_transfer_params"]["sekv"]["restored_tokens"]["host"] == sum(restored.values())
    assert step["output_token_ids"] == from_host["output_token_ids"]
    exact = run("exact", "exact-after-fp8")
    assert sum(exact["steps"][0]["kv_transfer_params"]["sekv"]["restored_tokens"].values()) == 0
    assert exact["steps"][0]["num_cached_tokens"] == 0
