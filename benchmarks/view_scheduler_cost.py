"""Scheduler-side cost of one agent step served from views, no model: admission,
the probe pass, the final pass and its step plan, at a 512K-token history held
in the workspace (32-token blocks, 64K views). Wall-clock times of the
engine-core-side Python alone (no profiler), median of 3 steps after a warm-up.

    python benchmarks/view_scheduler_cost.py
"""
import random
import statistics
import time

import numpy as np

from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request
from vllm_sekv.config import SekvConfig
from vllm_sekv.connector.views import ViewCoordinator
from vllm_sekv.store import LRUPolicy
from vllm_sekv.workspace.catalog import BlockCatalog
from vllm_sekv.workspace.hashing import extend_block_hashes
from vllm_sekv.workspace.planner import WorkspacePlanner
from vllm_sekv.workspace.sessions import SessionTable

N, BT, VIEW = 524288, 32, 65536
cfg = SekvConfig(view_tokens=VIEW)
catalog = BlockCatalog(N // BT + 64, LRUPolicy())
planner = WorkspacePlanner(catalog, SessionTable(), BT, 16)
views = ViewCoordinator(cfg, planner, window_tokens=131072, capacity_tokens=200000)
history = [random.randrange(1000, 128000) for _ in range(N)]
for b, h in enumerate(extend_block_hashes([], history, BT, "")):
    rec = catalog.reserve(start_token=b * BT)
    catalog.commit(rec, h)
prompt = history + [random.randrange(1000, 128000) for _ in range(64)]

def step(i):
    req = Request(f"r{i}", prompt, SamplingParams(max_tokens=1), None, block_hasher=None)
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
    return t

step(0)  # warm-up
runs = [step(i) for i in range(1, 4)]
medians = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
print(f"history {N} tokens, {BT}-token blocks, {VIEW}-token views; median of 3 steps, ms:")
for k, v in medians.items():
    print(f"  {k:12s} {v * 1e3:7.1f}")
print(f"  {'total':12s} {sum(medians.values()) * 1e3:7.1f}")
