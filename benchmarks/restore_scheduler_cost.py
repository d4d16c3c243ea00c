"""Scheduler-side cost of restoring a long history, no model: the three calls
vLLM makes before a restored request's forward (`match`, the hashing and
catalog lookup of `get_num_new_matched_tokens`; `accept`, the restore op of
`update_state_after_alloc`; `plan`, the step plan of `build_connector_meta`),
for a follow-up step whose whole history (`--tokens`, 32-token blocks) is in
the workspace, plus 64 new tokens, no session. Wall-clock times of the
engine-core-side Python alone (no profiler), median of 5 steps after two
warm-ups. On the GPU machine these run before the restore's first copy, so
they add to its time to first token. Then `decode`: the plan and
confirmation of one decode step of the restored request (one new token
captured each step; median of 200 steps), host time that a host-bound decode
adds to every token.

    python benchmarks/restore_scheduler_cost.py --tokens 65536

Writes benchmarks/results/scheduler_cost/restore.{json,md} (`--out DIR`), the
Markdown headed by the machine, commit and command; hand-written notes at its
end are kept.
"""
import argparse
import json
import random
import statistics
import time
from pathlib import Path

import report_header as H

from vllm_sekv.store import LRUPolicy
from vllm_sekv.workspace.catalog import BlockCatalog
from vllm_sekv.workspace.hashing import extend_block_hashes
from vllm_sekv.workspace.planner import WorkspacePlanner
from vllm_sekv.workspace.sessions import SessionTable

BT, PAGED_BLOCK = 32, 16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--out", default=str(H.results_dir("scheduler_cost")), help="writes OUT/restore.{json,md}")
    args = ap.parse_args()
    catalog = BlockCatalog(args.tokens // BT + 256, LRUPolicy())
    planner = WorkspacePlanner(catalog, SessionTable(), BT, PAGED_BLOCK)
    rng = random.Random(0)
    history = [rng.randrange(1000, 128000) for _ in range(args.tokens)]
    for b, h in enumerate(extend_block_hashes([], history, BT, "")):
        catalog.commit(catalog.reserve(start_token=b * BT), h)

    def step(i: int) -> dict[str, float]:
        prompt = history + [rng.randrange(1000, 128000) for _ in range(64)]
        rid, t = f"r{i}", {}
        t0 = time.perf_counter()
        n = planner.match(rid, prompt, "", None, 0)
        t["match"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        planner.set_paged_blocks(rid, list(range(len(prompt) // PAGED_BLOCK + 1)), replace=True)
        planner.accept_restore(rid, n)
        t["accept"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        plan = planner.plan_step({rid: (n, len(prompt) - n)}, lambda r: prompt)
        t["plan"] = time.perf_counter() - t0
        assert sum(len(op.host_rows) for op in plan.restores) == n == args.tokens
        planner.confirm(plan.step_id, set(), lambda r: prompt)
        planner.finish(rid, prompt, len(prompt))
        planner.confirm(plan.step_id, set(), lambda r: prompt)
        return t

    for i in range(2):
        step(i)
    runs = [step(i) for i in range(2, 7)]
    total = statistics.median(sum(r.values()) for r in runs)
    print(f"restore of {args.tokens} tokens, scheduler side: " + ", ".join(
        f"{k} {statistics.median(r[k] for r in runs) * 1e3:.2f} ms" for k in runs[0]) + f"; total {total * 1e3:.2f} ms")

    tokens = history + [rng.randrange(1000, 128000) for _ in range(64)]
    n = planner.match("decode", tokens, "", None, 0)
    planner.set_paged_blocks("decode", list(range(len(tokens) // PAGED_BLOCK + 256)), replace=True)
    planner.accept_restore("decode", n)
    plan = planner.plan_step({"decode": (n, len(tokens) - n)}, lambda r: tokens)
    planner.confirm(plan.step_id, set(), lambda r: tokens)
    seconds = []
    for _ in range(220):
        position = len(tokens)
        tokens.append(rng.randrange(1000, 128000))  # the token sampled last step, computed in this one
        t0 = time.perf_counter()
        plan = planner.plan_step({"decode": (position, 1)}, lambda r: tokens)
        planner.confirm(plan.step_id, set(), lambda r: tokens)
        seconds.append(time.perf_counter() - t0)
        assert len(plan.capture_paged_slots) == 1
    decode_us = statistics.median(seconds[20:]) * 1e6
    print(f"decode step of the restored request, scheduler side: {decode_us:.1f} us")
    data = {"meta": H.meta(H.command(__file__)), "tokens": args.tokens,
            "median_ms": {k: statistics.median(r[k] for r in runs) * 1e3 for k in runs[0]},
            "total_ms": total * 1e3, "runs_ms": [{k: v * 1e3 for k, v in r.items()} for r in runs],
            "decode_us": decode_us}
    write(data, Path(args.out))


def write(data: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "restore.json").write_text(json.dumps(data, indent=1) + "\n")
    med = data["median_ms"]
    H.write_report(out / "restore.md", [
        *H.header_from(data["meta"], "Scheduler-side host cost of a restore (no model)"),
        f"A follow-up whose whole history ({data['tokens']} tokens, 32-token blocks) is in the workspace, plus 64 "
        "new tokens: the engine-core-side Python of the three calls vLLM makes before the restore's forward, "
        "median of 5 steps after two warm-ups; then one decode step of the restored request (plan + "
        "confirmation, median of 200).", "",
        "| match | accept | plan | total | decode step |", "|---|---|---|---|---|",
        f"| {med['match']:.2f} ms | {med['accept']:.2f} ms | {med['plan']:.2f} ms | {data['total_ms']:.2f} ms | "
        f"{data['decode_us']:.1f} us |"])


if __name__ == "__main__":
    main()
