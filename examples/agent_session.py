"""A multi-step agent session against a vLLM server with the sekv connector.

Each step appends a tool-output turn (a slice of a real essay) and a question
to the conversation and sends the whole history, as agents do. Between steps
the server's own prefix cache is reset (POST /reset_prefix_cache, as if other
sessions had pushed this one out of the GPU cache): vLLM alone would prefill
the whole history again; with sekv the history is restored from host memory
and only the new turn is prefilled.

Per step it prints the prompt size, the tokens restored by sekv (from its
Prometheus counter), the tokens prefilled (from the usage report) and the
time to first token measured by this client.

  python examples/agent_session.py                 # starts `vllm-sekv serve smollm2`
  python examples/agent_session.py --url http://127.0.0.1:8000   # an existing server
                                                   # (started with VLLM_SERVER_DEV_MODE=1
                                                   #  and --enable-prompt-tokens-details)
"""
from __future__ import annotations

import argparse
import re
import time
import urllib.request

from openai import OpenAI

from vllm_sekv.essays import essay_text


def counter(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def reset_vllm_cache(url: str) -> None:
    req = urllib.request.Request(url + "/reset_prefix_cache", method="POST")
    urllib.request.urlopen(req, timeout=30).close()


def run_session(url: str, steps: int, turn_chars: int, max_tokens: int, reset: bool) -> list[dict]:
    client = OpenAI(base_url=url + "/v1", api_key="none")
    model = client.models.list().data[0].id
    text = essay_text(max_chars=steps * turn_chars)
    messages = [{"role": "system", "content": "You are a careful research agent. Answer briefly."}]
    rows = []
    print(f"{'step':>4} {'prompt':>7} {'restored':>9} {'prefilled':>10} {'ttft_ms':>8}  answer")
    for step in range(steps):
        chunk = text[step * turn_chars : (step + 1) * turn_chars]
        messages.append({"role": "user", "content": f"Tool output (read_file):\n{chunk}\n\n"
                         "What is the main claim of this passage? One sentence."})
        if reset:
            reset_vllm_cache(url)
        restored_before = counter(url, "vllm:sekv_restored_tokens_total")
        t0 = time.perf_counter()
        ttft_s, answer, usage = None, "", None
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"session_id": "agent-demo"},
        )
        for event in stream:
            if event.choices and event.choices[0].delta.content:
                ttft_s = ttft_s or time.perf_counter() - t0
                answer += event.choices[0].delta.content
            if event.usage:
                usage = event.usage
        cached = (usage.prompt_tokens_details.cached_tokens or 0) if usage.prompt_tokens_details else 0
        row = {
            "step": step + 1,
            "prompt_tokens": usage.prompt_tokens,
            "restored_tokens": int(counter(url, "vllm:sekv_restored_tokens_total") - restored_before),
            "prefilled_tokens": usage.prompt_tokens - cached,
            "ttft_ms": round(1000 * (ttft_s or time.perf_counter() - t0), 1),
        }
        rows.append(row)
        print(f"{row['step']:>4} {row['prompt_tokens']:>7} {row['restored_tokens']:>9} "
              f"{row['prefilled_tokens']:>10} {row['ttft_ms']:>8}  {answer.strip()[:60]!r}")
        messages.append({"role": "assistant", "content": answer})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="use this running server instead of starting one")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--turn-chars", type=int, default=4000, help="size of each tool output")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--host-bytes", default="2G")
    ap.add_argument("--keep-vllm-cache", action="store_true",
                    help="do not reset vLLM's prefix cache between steps")
    args = ap.parse_args()
    if args.url:
        run_session(args.url, args.steps, args.turn_chars, args.max_tokens, not args.keep_vllm_cache)
        return
    from vllm_sekv.models import prepare_model
    from vllm_sekv.serving import LocalServer

    model = str(prepare_model())
    print("starting vLLM with the sekv connector (about a minute on CPU) ...", flush=True)
    server = LocalServer(
        model,
        sekv={"host_bytes": args.host_bytes},
        vllm_args=["--max-model-len", "8192", "--enforce-eager", "--enable-prompt-tokens-details",
                   "--gpu-memory-utilization", "0.5"],
        env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    with server:
        print(f"server up at {server.url} (log: {server.log_path})")
        run_session(server.url, args.steps, args.turn_chars, args.max_tokens, not args.keep_vllm_cache)


if __name__ == "__main__":
    main()
