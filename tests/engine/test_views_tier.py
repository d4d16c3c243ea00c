"""Sessions that take turns on a host tier too small for both, through a real
`vllm serve` (SmolLM2, float32).

The tier (600 MB) holds about 1.6 of these 8K-token sessions, and an ingest
pass spans several engine steps (1024 tokens each). The first session's
history, used at every step, is what the SLRU policy protects; a
second session's history must still fit whole while it is ingested: its own
new blocks are never the victims of its later captures, the idle session's
are. Served otherwise, its step would find part of its history gone and
answer from its last tokens only (`truncated`)."""
import pytest

from test_http_serve import post
from testbed.serving import LocalServer

pytestmark = pytest.mark.engine

VLLM_ARGS = ["--max-model-len", "16384", "--max-num-batched-tokens", "1024", "--enforce-eager",
             "--dtype", "float32", "--gpu-memory-utilization", "0.5"]
ENV = {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1", "VLLM_CPU_KVCACHE_SPACE": "4"}


def test_a_second_session_is_ingested_whole_beside_an_idle_one(model_dir, eval_tasks):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    with LocalServer(model_dir, sekv={"host_bytes": "600M", "view_tokens": 2048}, vllm_args=VLLM_ARGS,
                     env=ENV) as server:
        views = []
        for seed, steps in ((3, 2), (4, 1)):  # the first session used twice: its blocks are protected
            task = eval_tasks.generate("passkey", 8192, seed, tok)
            for _ in range(steps):
                body = {"model": model_dir, "messages": task.messages, "max_tokens": 2, "temperature": 0,
                        "session_id": f"s{seed}", "kv_transfer_params": {"view_tokens": 2048}}
                views.append(post(server.url, "/v1/chat/completions", body)["kv_transfer_params"]["sekv"]["view"])
    first, again, second = views
    assert first["passes"]["ingest"] >= 4 and "ingest" not in again["passes"]
    assert not second.get("truncated") and second["passes"]["probe"] == 1
    assert second["passes"]["ingest"] == first["passes"]["ingest"]
