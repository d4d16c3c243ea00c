"""The long fault-injection run (`harness.py`): SmolLM2 through real `vllm serve`.

    python benchmarks/faults/run.py --faults 1000 --seed 7 --out benchmarks/results/faults

Computes plain vLLM's greedy answers to every session step, then runs the
sekv server (tiny host and NVMe budgets, the NVMe folder on a small tmpfs
where it can mount one) through `--faults` seeded faults. Writes
`summary.json` (`{"commit", "seed", "faults_injected", "faults_by_kind",
"kills", "restarts", "requests", "wrong_tokens", "engine_crashes",
"failed_startups", "restored_after_restart_tokens", ..., "meta"}`), `report.md`
headed by the machine, commit and command (`--report-only` writes it again
from summary.json), and `run.log` (every fault as it was injected, and the
counters after it).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # testbed
import report_header as H  # noqa: E402
from harness import FaultRun, sessions  # noqa: E402

VLLM_ARGS = ["--max-model-len", "4096", "--enforce-eager", "--dtype", "float32", "--gpu-memory-utilization", "0.5"]
ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
SEKV = {"host_bytes": "48M", "nvme_bytes": "96M", "block_tokens": 32}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", type=int, default=1000)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--max-kills", type=int, default=None)
    p.add_argument("--requests-per-fault", type=float, default=0.3)
    p.add_argument("--out", default=str(H.results_dir("faults")))
    p.add_argument("--model", default=None, help="model folder (default: the bundled SmolLM2)")
    p.add_argument("--report-only", action="store_true", help="only write report.md again from summary.json")
    args = p.parse_args(argv)
    if args.report_only:
        write_report(json.loads((Path(args.out) / "summary.json").read_text()), Path(args.out))
        return 0
    from vllm_sekv.calibration_corpus import essay_text
    from vllm_sekv.models import prepare_model

    model = args.model or str(prepare_model(quiet=True))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_file = open(out / "run.log", "w")

    def log(line: str) -> None:
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    essay = essay_text(max_chars=200_000)
    steps = sessions(essay)
    survivor = sessions(essay, tenants=1, per_tenant=1, steps=2, skip_chars=2 * 2 * 5 * 1400, name="survivor")[0]
    work = Path(tempfile.mkdtemp(prefix="sekv-faults-"))
    # The servers run a copy of the package as it is now: edits during a long run never reach a restart.
    code = work / "code"
    shutil.copytree(Path(__file__).resolve().parents[2] / "vllm_sekv", code / "vllm_sekv")
    env = {**ENV, "PYTHONPATH": str(code)}
    run = FaultRun(model, work, args.seed, VLLM_ARGS, env, SEKV, log=log)
    t0 = time.time()
    try:
        run.compute_reference([s for session in steps for s in session] + survivor)
        counters = run.run(args.faults, steps, args.requests_per_fault, max_kills=args.max_kills, survivor=survivor)
    finally:
        run.close()
    meta = H.meta(H.command(__file__, argv))
    summary = {"commit": meta["commit"], "seed": args.seed, **counters.summary(),
               "seconds": round(time.time() - t0), "tmpfs": run.tmpfs, "meta": meta}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    write_report(summary, out)
    log(json.dumps(summary))
    return 0 if summary["wrong_tokens"] == summary["engine_crashes"] == summary["failed_startups"] == 0 else 1


def write_report(summary: dict, out: Path) -> None:
    rows = [f"| {k} | {v} |" for k, v in summary.items() if k not in ("faults_by_kind", "meta")]
    kinds = [f"| {k} | {v} |" for k, v in summary["faults_by_kind"].items()]
    H.write_report(out / "report.md", [
        *H.header_from(summary["meta"], "Fault injection"),
        f"SmolLM2-135M-Instruct (float32) through real `vllm serve` with sekv: host tier {SEKV['host_bytes']}, "
        f"NVMe tier {SEKV['nvme_bytes']} on a small tmpfs; every answer compared token by token with plain "
        f"vLLM's greedy answer to the same prompt; {summary['seconds']} s. `run.log`: every fault as it was "
        "injected, and the counters after it.", "",
        "| figure | value |", "|---|---|", *rows, "",
        "| fault | injected |", "|---|---|", *kinds])


if __name__ == "__main__":
    sys.exit(main())
