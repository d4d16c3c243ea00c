"""The same through the OpenAI-compatible HTTP endpoint of a real `vllm serve`.

The sekv server is started with the one flag users pass,
`--kv-transfer-config '{"kv_connector":"sekv","kv_role":"kv_both"}'`, and its
host budget from the environment (`SEKV_HOST_BYTES`). A 3-step chat session
with a `session_id`, vLLM's prefix cache reset before each step, must give the
greedy answers of a plain server and restore the history at steps 2 and 3.
The sekv server runs its scheduler hook (execution views) as every sekv
server does; a view budget at least as large as the history (here asked for
per request) serves the whole history, exactly.
"""
import json
import urllib.error
import urllib.request

import pytest

from testbed.serving import LocalServer

pytestmark = pytest.mark.engine

VLLM_ARGS = ["--max-model-len", "8192", "--enforce-eager", "--dtype", "float32",
             "--enable-prompt-tokens-details", "--gpu-memory-utilization", "0.5"]
ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "SEKV_HOST_BYTES": "512M"}
BLOCK_TOKENS = 32


def post(url, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as r:
        raw = r.read()
    return json.loads(raw) if raw else None


def chat_session(url, model, essay, extra=None):
    messages = [{"role": "system", "content": "You are a careful research agent."}]
    steps = []
    for i in range(3):
        chunk = essay[i * 2500 : (i + 1) * 2500]
        messages.append({"role": "user", "content": f"Tool output:\n{chunk}\n\nSummarize it in one line."})
        post(url, "/reset_prefix_cache")
        body = {"model": model, "messages": messages, "max_tokens": 16, "temperature": 0,
                "session_id": "agent-1", **(extra or {})}
        r = post(url, "/v1/chat/completions", body)
        steps.append(r)
        messages.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
    return steps


BAD_REQUESTS = {  # name -> extra body fields of a chat request
    "max_tokens": {"max_tokens": -5},  # vLLM's own check
    "view_tokens": {"kv_transfer_params": {"view_tokens": "many"}},
    "tiny_view": {"kv_transfer_params": {"view_tokens": 8}},
    "coarse": {"kv_transfer_params": {"coarse": "yes"}},
    "unknown_key": {"kv_transfer_params": {"view_token": 2048}},
    "xargs": {"vllm_xargs": {"view_tokens": -1}},
    "recompute": {"kv_transfer_params": {"recompute_blocks": -2}},
}
BAD_REQUESTS_FIELD = {"max_tokens": "max_tokens", "view_tokens": "kv_transfer_params.view_tokens",
                      "tiny_view": "kv_transfer_params.view_tokens", "coarse": "kv_transfer_params.coarse",
                      "unknown_key": "'view_token'", "xargs": "vllm_xargs.view_tokens",
                      "recompute": "kv_transfer_params.recompute_blocks"}


def refusal(url, model, extra):
    """(HTTP status, error message) of a chat request with `extra` fields."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    try:
        post(url, "/v1/chat/completions", body)
        return 200, ""
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


@pytest.fixture(scope="module")
def sessions(model_dir, essay):
    with LocalServer(model_dir, sekv={}, vllm_args=VLLM_ARGS, env=ENV) as server:
        sekv = chat_session(server.url, model_dir, essay, {"kv_transfer_params": {"view_tokens": 8192}})
        # Malformed requests are refused with a clear error and lose nothing stored.
        bad = {name: refusal(server.url, model_dir, body) for name, body in BAD_REQUESTS.items()}
        again = chat_session(server.url, model_dir, essay)
        other_tenant = post(server.url, "/v1/chat/completions", {
            "model": model_dir, "messages": [{"role": "user", "content": essay[:400]}], "max_tokens": 4,
            "cache_salt": "another-tenant"})
        with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
            metrics = r.read().decode()
    with LocalServer(model_dir, sekv=None, vllm_args=VLLM_ARGS, env=ENV) as server:
        plain = chat_session(server.url, model_dir, essay)
    return plain, sekv, bad, again, metrics, other_tenant


def test_answers_equal_plain_vllm(sessions):
    plain, sekv, _, _, _, _ = sessions
    for p, s in zip(plain, sekv):
        assert s["choices"][0]["message"]["content"] == p["choices"][0]["message"]["content"]
        assert s["usage"]["prompt_tokens"] == p["usage"]["prompt_tokens"]
        assert "view" not in s["kv_transfer_params"]["sekv"]  # the whole history, no selection


def test_history_is_restored_not_prefilled(sessions):
    plain, sekv, _, _, _, _ = sessions
    assert all(p["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 for p in plain)
    assert sekv[0]["kv_transfer_params"]["sekv"]["restored_tokens"]["host"] == 0
    for prev, step in zip(sekv, sekv[1:]):
        params = step["kv_transfer_params"]["sekv"]
        restored = params["restored_tokens"]["host"]
        # at least every full block of the previous prompt comes back
        assert restored >= prev["usage"]["prompt_tokens"] // BLOCK_TOKENS * BLOCK_TOKENS
        assert step["usage"]["prompt_tokens_details"]["cached_tokens"] == restored
        assert params["prefilled_tokens"] == step["usage"]["prompt_tokens"] - restored


def test_a_response_counts_only_its_own_tenants_blocks(sessions):
    _, sekv, _, again, _, other = sessions
    mine = again[-1]["kv_transfer_params"]["sekv"]["workspace_blocks"]
    theirs = other["kv_transfer_params"]["sekv"]["workspace_blocks"]
    assert mine > 20 and theirs < 20  # the other tenant's first short request sees none of this session


def test_bad_request_gets_a_clear_error_and_loses_nothing(sessions):
    _, sekv, bad, again, _, _ = sessions
    for name, (status, message) in bad.items():
        assert status == 400, (name, status, message)
        assert BAD_REQUESTS_FIELD[name] in message, (name, message)
    # The repeated session finds its whole history, first step included.
    assert again[0]["kv_transfer_params"]["sekv"]["restored_tokens"]["host"] > 0
    for first, second in zip(sekv, again):
        assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


def test_connector_stats_reach_prometheus(sessions):
    _, sekv, _, again, metrics, _ = sessions
    restored = sum(s["kv_transfer_params"]["sekv"]["restored_tokens"]["host"] for s in sekv + again)
    values = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith("vllm:sekv_restored_tokens_total")]
    assert values and sum(values) == restored


def test_the_api_server_tokenizes_a_growing_chat_from_its_last_prompts_tokens(sessions):
    """Step 3 of a session takes its history's tokens from step 2's prompt
    (all of it before step 2's generation prompt) instead of tokenizing it
    again; its prompt and answer equal plain vLLM's (above)."""
    _, sekv, _, _, metrics, _ = sessions
    values = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith("vllm:sekv_prompt_tokens_reused_total")]
    assert values and values[0] >= sekv[1]["usage"]["prompt_tokens"] - 8


def test_bad_config_fails_at_start_naming_the_key(model_dir):
    server = LocalServer(model_dir, sekv={"host_bytes": "lots"}, vllm_args=VLLM_ARGS, env=ENV)
    with pytest.raises(RuntimeError, match="server exited"):
        server.start(timeout_s=300)
    server.stop()
    log = server.log_path.read_text(errors="replace")
    assert "sekv config 'host_bytes': expected a size like 8G" in log
