"""What the evaluation's runs share (`run_eval.py`, `views_run.py`,
`sekv_eval.py`): where they write their results, and talking to a vLLM
server's OpenAI endpoint (start one, read its sekv counters, reset its prefix
cache, stream one greedy request). Imports nothing of theirs, so neither
imports the other for it.
"""
from __future__ import annotations

import os
import shlex
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # testbed
import report_header as H  # noqa: E402
from testbed import serving  # noqa: E402

RESULTS = H.RESULTS
BASELINES_OUT = H.results_dir("eval_baselines") / "report"  # run_eval.py --method full sliding
VIEWS_OUT = H.results_dir("views_eval") / "report"          # run_eval.py --method sekv-views (views_run.py)
SEKV_EVAL_DIR = H.results_dir("sekv_eval")                  # sekv_eval.py: one <length>k.* per history length
ROUTER = H.results_dir("router_calibration") / "router_smollm2.pt"
VIEWS_COUNTER = "vllm:sekv_views_total"
VLLM_ARGS = ["--enforce-eager", "--gpu-memory-utilization", "0.5", "--enable-prompt-tokens-details"]


class SekvViewsUnsupported(RuntimeError):
    """The server cannot serve execution views; no number is reported for it."""


# ---------------------------------------------------------------- server side

def metrics(url: str) -> dict[str, float]:
    """All `vllm:sekv_*` samples of /metrics, summed over labels."""
    return serving.metrics(url, "vllm:sekv_")


def reset_prefix_cache(url: str) -> bool:
    try:
        req = urllib.request.Request(url + "/reset_prefix_cache", method="POST")
        urllib.request.urlopen(req, timeout=30).close()
        return True
    except (urllib.error.URLError, OSError):
        return False


def require_views(url: str) -> None:
    try:
        found = VIEWS_COUNTER in metrics(url)
    except (urllib.error.URLError, OSError) as e:
        raise SekvViewsUnsupported(f"cannot read {url}/metrics: {e}") from e
    if not found:
        raise SekvViewsUnsupported(
            f"the server at {url} does not export {VIEWS_COUNTER}: it has no sekv execution "
            "views (plain vLLM, or sekv without views). Start it with the sekv connector and "
            "view support (see benchmarks/eval/README.md); no sekv-views numbers are reported.")


def start_server(model_dir: str, args, sekv: dict | None, max_model_len: int | None = None,
                 env: dict | None = None):
    from testbed.serving import LocalServer

    log = Path(tempfile.gettempdir()) / f"sekv_eval_server_{'sekv' if sekv is not None else 'plain'}_{os.getpid()}.log"
    dtype = ["--dtype", args.dtype] if args.dtype else []
    server = LocalServer(model_dir, sekv=sekv, log_path=log,
                         vllm_args=["--max-model-len", str(max_model_len or args.max_model_len), *dtype,
                                    *VLLM_ARGS, *shlex.split(args.server_args)],
                         env={"VLLM_CPU_KVCACHE_SPACE": str(args.kv_space_gib),
                              "VLLM_SERVER_DEV_MODE": "1", **(env or {})})
    print(f"starting {'sekv' if sekv is not None else 'plain'} vLLM server (log: {log}):\n  "
          f"{' '.join(server.cmd[1:])}\n  env {env or {}}", flush=True)
    server.log = log
    return server.start(timeout_s=900)


# ---------------------------------------------------------------- one request

def ask(client, model: str, messages: list[dict], max_tokens: int, extra: dict) -> dict:
    """Stream one greedy chat completion; time to first content chunk and usage."""
    body = dict(extra)
    if messages[-1]["role"] == "assistant":  # answer prefix: the model continues it
        body.update(continue_final_message=True, add_generation_prompt=False)
    t0 = time.perf_counter()
    ttft, text, usage = None, "", None
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body=body)
    for event in stream:
        if event.choices and event.choices[0].delta.content:
            if ttft is None:
                ttft = time.perf_counter() - t0
            text += event.choices[0].delta.content
        if event.usage:
            usage = event.usage
    total = time.perf_counter() - t0
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    return {"response": text, "ttft_s": ttft if ttft is not None else total, "total_s": total,
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "cached_tokens": (details.cached_tokens or 0) if details else None}


