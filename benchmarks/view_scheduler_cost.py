"""Scheduler-side cost of one agent step served from views, no model: admission,
the probe pass, the final pass and its step plan, and the request's end (the
session's history recorded), at a 512K-token history (`--history-tokens`) held
in the workspace (32-token blocks, 64K views). Wall-clock times of the
engine-core-side Python alone (no profiler), median of 3 steps after a warm-up.
Then the same side of decoding: per generated token, the step plan (capture of
the token at its virtual position) and the confirmation that commits finished
blocks, the request's tokens given as the view job gives them (history +
generated), mean over 128 tokens.

    python benchmarks/view_scheduler_cost.py [--history-tokens 1048576 --out DIR]

Writes benchmarks/results/scheduler_cost/views.{json,md} (`--out DIR`), the
Markdown headed by the machine, commit and command; hand-written notes at its
end are kept.
"""
import argparse
import json
import random
import statistics
import time
from pathlib import Path

import numpy as np

import report_header as H

from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request
from vllm_sekv.config import SekvConfig
from vllm_sekv.scheduler_side.view_coordinator import ViewCoordinator
from vllm_sekv.store import LRUPolicy
from vllm_sekv.workspace.catalog import BlockCatalog
from vllm_sekv.workspace.hashing import JoinedTokens, extend_block_hashes
from vllm_sekv.workspace.planner import WorkspacePlanner
from vllm_sekv.workspace.sessions import SessionTable

BT, VIEW = 32, 65536
ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--out", default=str(H.results_dir("scheduler_cost")), help="writes OUT/views.{json,md}")
ap.add_argument("--history-tokens", type=int, default=524288, help="the history the workspace holds")
args = ap.parse_args()
N = args.history_tokens
cfg = SekvConfig(view_tokens=VIEW)
catalog = BlockCatalog(N // BT + 64, LRUPolicy())
planner = WorkspacePlanner(catalog, SessionTable(), BT, 16)
views = ViewCoordinator(cfg, planner, tenant_of=str, window_tokens=131072, capacity_tokens=200000)
history = [random.randrange(1000, 128000) for _ in range(N)]
for b, h in enumerate(extend_block_hashes([], history, BT, "")):
    rec = catalog.reserve(start_token=b * BT)
    catalog.commit(rec, h)
prompt = history + [random.randrange(1000, 128000) for _ in range(64)]

def step(i, finish=True):
    req = Request(f"r{i}", prompt, SamplingParams(max_tokens=1), None, block_hasher=None)
    req.session_id = "agent"  # one session: each step's history extends the last one's
    t = {}
    t0 = time.perf_counter(); views.admit(req); t["admit"] = time.perf_counter() - t0
    t0 = time.perf_counter(); n = views.next_pass(req); t["probe pass"] = time.perf_counter() - t0
    planner.set_paged_blocks(req.request_id, list(range(req.num_tokens // 16 + 2)), replace=True)
    job = views.jobs[req.request_id]
    job.scores = np.random.rand(len(job.current.candidates)).astype(np.float32)
    t0 = time.perf_counter(); views.pass_done(req, lambda rid: prompt); t["pass done"] = time.perf_counter() - t0
    t0 = time.perf_counter(); n = views.next_pass(req); t["final pass"] = time.perf_counter() - t0
    planner.set_paged_blocks(req.request_id, list(range(req.num_tokens // 16 + 2)), replace=True)
    t0 = time.perf_counter(); plan = planner.plan_step({req.request_id: (n, req.num_tokens - n)}, lambda rid: prompt); t["plan step"] = time.perf_counter() - t0
    planner.confirm(plan.step_id, set(), lambda rid: prompt)
    if finish:
        t0 = time.perf_counter(); end(req); t["finish"] = time.perf_counter() - t0
    return t, req


def end(req):
    """What the scheduler side does when vLLM finishes the request (`request_finished`)."""
    req.num_computed_tokens = req.num_tokens
    tokens, computed = views.virtual_progress(req)
    views.finish(req)
    planner.finish(req.request_id, tokens, computed)


def decode(req, tokens=128):
    """Mean seconds per generated token of the scheduler side's plan + confirm."""
    generated: list[int] = []
    tokens_of = lambda rid: JoinedTokens(prompt, generated)  # noqa: E731 (ViewJob.virtual_tokens)
    view_len = req.num_tokens  # the final pass's sequence; each token extends it
    pages = view_len // 16 + 2  # the final pass's pages, given in step()
    t0 = time.perf_counter()
    for i in range(tokens):  # step i computes the token sampled before it, at view position view_len + i
        generated.append(random.randrange(1000, 128000))
        if (view_len + i) // 16 + 2 > pages:  # vLLM hands over a step's new pages only
            planner.set_paged_blocks(req.request_id, [pages], replace=False)
            pages += 1
        plan = planner.plan_step({req.request_id: (view_len + i, 1)}, tokens_of)
        assert len(plan.capture_host_rows) == 1  # the token is saved at its virtual position
        planner.confirm(plan.step_id, set(), tokens_of)
    return (time.perf_counter() - t0) / tokens

step(0)  # warm-up
runs = [step(i)[0] for i in range(1, 4)]
medians = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
print(f"history {N} tokens, {BT}-token blocks, {VIEW}-token views; median of 3 steps, ms:")
for k, v in medians.items():
    print(f"  {k:12s} {v * 1e3:7.1f}")
print(f"  {'total':12s} {sum(medians.values()) * 1e3:7.1f}")
_, req = step(4, finish=False)
per_token = decode(req)
end(req)
print(f"decode: {per_token * 1e3:.2f} ms per token (plan + confirm, mean of 128 tokens)")

data = {"meta": H.meta(H.command(__file__)), "history_tokens": N, "block_tokens": BT, "view_tokens": VIEW,
        "step_median_ms": {k: v * 1e3 for k, v in medians.items()}, "step_total_ms": sum(medians.values()) * 1e3,
        "decode_ms_per_token": per_token * 1e3}
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
(out / "views.json").write_text(json.dumps(data, indent=1) + "\n")
H.write_report(out / "views.md", [
    *H.header_from(data["meta"], "Scheduler-side host cost of a step served from views (no model)"),
    f"A {N}-token history in the workspace ({BT}-token blocks), {VIEW}-token views: admission, the probe "
    "pass, the final pass and its step plan, the request's end (median of 3 steps of one session after a "
    "warm-up), then decoding (plan + "
    "confirmation per generated token, mean of 128 tokens).", "",
    "| " + " | ".join(data["step_median_ms"]) + " | step total | decode, per token |",
    "|---" * (len(data["step_median_ms"]) + 2) + "|",
    "| " + " | ".join(f"{v:.1f} ms" for v in data["step_median_ms"].values())
    + f" | {data['step_total_ms']:.1f} ms | {data['decode_ms_per_token']:.2f} ms |"])
