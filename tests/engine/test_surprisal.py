"""SeKV surprisal (config `surprisal` on): what sekv records for each captured
token equals vLLM's own prompt logprobs of the same tokens, through chunked
prefill (the stash carries a chunk's last hidden state to the next chunk) and
decode steps (each step's token is scored by the previous step's state).

Engines, each in its own process: sekv serving a 1,200-token prompt in
256-token chunks plus 24 greedy tokens, its blocks written to an NVMe folder;
plain vLLM computing `prompt_logprobs` of prompt + those tokens; a fresh sekv
engine restoring the prompt from that folder, whose surprisal comes back from
the records. float32: the chunks line up, decode does not (one token per
step against a prefill chunk), and in bf16 a CPU's GEMMs round differently
for different row counts (sekv scores the predecessors of captured tokens,
vLLM every prompt token): 0.2 nats apart on an AVX2 CPU, within 1e-3 on an
AVX-512 one.
"""
import math

import pytest

from engine_process import run_runner

pytestmark = pytest.mark.engine

PROMPT_TOKENS, MAX_TOKENS, CHUNK_TOKENS = 1200, 24, 256


def run(tmp_path, spec):
    return run_runner("surprisal_runner.py", spec, tmp_path, spec["mode"])


def test_recorded_surprisal_equals_vllms_prompt_logprobs(tmp_path, model_dir, essay):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)(essay)["input_ids"][:PROMPT_TOKENS]
    base = {"model": model_dir, "max_tokens": MAX_TOKENS, "max_num_batched_tokens": CHUNK_TOKENS,
            "dtype": "float32"}
    nvme = str(tmp_path / "nvme")
    sekv = run(tmp_path, {**base, "mode": "sekv", "prompt_token_ids": ids, "nvme_dir": nvme})
    full = ids + sekv["output_token_ids"]
    plain = run(tmp_path, {**base, "mode": "plain", "prompt_token_ids": full})
    recorded = sekv["surprisal"]
    expected = plain["surprisal"][:len(recorded)]
    assert len(recorded) >= PROMPT_TOKENS  # the prompt's blocks and some decoded ones were committed
    assert math.isnan(recorded[0])  # token 0 has no predecessor
    pairs = list(zip(recorded[1:], expected[1:]))
    assert not any(math.isnan(r) for r, _ in pairs)
    prompt_err = max(abs(r - e) for r, e in pairs[:PROMPT_TOKENS - 1])
    decode_err = max((abs(r - e) for r, e in pairs[PROMPT_TOKENS - 1:]), default=0.0)
    assert prompt_err <= 1e-3, prompt_err  # same chunks, same kernels (2.7e-5 measured)
    assert decode_err <= 1e-3, decode_err  # one token per step vs a prefill chunk (1.3e-5 measured)

    # A fresh engine restores the prompt's blocks from disk, with their surprisal.
    restored = run(tmp_path, {**base, "mode": "restore", "prompt_token_ids": ids, "nvme_dir": nvme})
    assert restored["kv_transfer_params"]["sekv"]["restored_tokens"]["nvme"] >= PROMPT_TOKENS - 32
    n = len(restored["surprisal"])
    assert n >= PROMPT_TOKENS - 32
    back = restored["surprisal"]
    assert all(math.isnan(a) and math.isnan(b) or a == b for a, b in zip(back, recorded[:n]))
