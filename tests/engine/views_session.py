"""The 16K reader session that tests/engine/test_views_serve.py (CPU) and
tests/gpu/test_cuda_views.py (CUDA) serve through a real `vllm serve`.

An agent reads documents step by step until its history passes 16K tokens (a
pass key sits in an early document, ~10.6K tokens before the question: beyond
SmolLM2's 8192-token window), asks for the key, then edits its history (drops
the last document) and asks again. Requests ask for a 4096-token view budget
through `kv_transfer_params`.
"""
import time
import urllib.request

from test_http_serve import post
from testbed.serving import LocalServer, metrics

VIEW = {"view_tokens": 4096}
HISTORY_TOKENS = 16384
SEED = 3  # the pass key sits at 35% depth, ~10.6K tokens before the question
NATIVE_WINDOW = 8192
BT = 32


def tool_turn_ends(messages):
    """Indices just past each tool message: the agent's steps."""
    return [i + 1 for i, m in enumerate(messages) if m["role"] == "tool"]


def restore_seconds_counter(url):
    """The server's `vllm:sekv_restore_seconds_total` (Prometheus), summed over engines."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:sekv_restore_seconds_total"))


def counted_restore_seconds(url, before, timeout_s=10.0):
    """What the restore counter added since `before` (stats reach the metrics
    with the step's output, so wait until it moves)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = restore_seconds_counter(url)
        if now != before or time.monotonic() > deadline:
            return now - before
        time.sleep(0.2)


def needle_block(tok, tasks, task):
    """(workspace block holding the pass key's first digit, its distance from the prompt's end)."""
    ids = tasks.render_ids(tok, task.messages)
    digits = tok.encode(task.answer, add_special_tokens=False)
    starts = [i for i in range(len(ids)) if ids[i : i + len(digits)] == digits]
    assert starts, "the pass key's tokens are not in the prompt"
    return starts[0] // BT, len(ids) - starts[0]


def run_reader_session(model_dir, eval_tasks, sekv, vllm_args, env, view=VIEW):
    """(tokenizer, task, step responses, 1-token answer, answer, answer after the edit);
    the last response carries the server's `vllm:sekv_*` counters at the end
    (`server_metrics`). `view`: every request's `kv_transfer_params`."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    task = eval_tasks.generate("passkey", HISTORY_TOKENS, SEED, tok)
    with LocalServer(model_dir, sekv=sekv, vllm_args=vllm_args, env=env) as server:
        steps = []
        ends = tool_turn_ends(task.messages)
        for end in ends[3::4] + [ends[-1]]:  # a few documents per step
            body = {"model": model_dir, "messages": task.messages[:end], "max_tokens": 6,
                    "temperature": 0, "session_id": "reader", "kv_transfer_params": view}
            steps.append(post(server.url, "/v1/chat/completions", body))
        question = {"model": model_dir, "messages": task.messages, "temperature": 0,
                    "session_id": "reader", "kv_transfer_params": view,
                    "continue_final_message": True, "add_generation_prompt": False}
        counter = restore_seconds_counter(server.url)
        one = post(server.url, "/v1/chat/completions", {**question, "max_tokens": 1})
        # every restore of this one request, as the server's metrics counted them
        one["restore_seconds_counted"] = counted_restore_seconds(server.url, counter)
        answer = post(server.url, "/v1/chat/completions", {**question, "max_tokens": 10})
        # The agent edits its history: it drops the last document it read
        # (call and result). The workspace is cut there and the question forks
        # from the kept history.
        late = max(i for i, m in enumerate(task.messages) if m["role"] == "tool")
        edited = task.messages[: late - 1] + task.messages[late + 1 :]
        after_edit = post(server.url, "/v1/chat/completions",
                          {**question, "messages": edited, "max_tokens": 10})
        after_edit["server_metrics"] = metrics(server.url, "vllm:sekv_")
    return tok, task, steps, one, answer, after_edit


def sekv_params(response):
    return response["kv_transfer_params"]["sekv"]
