"""The long fault-injection run (`harness.py`): SmolLM2 through real `vllm serve`.

    python benchmarks/faults/run.py --faults 1000 --seed 7 --out benchmarks/results/faults

Computes plain vLLM's greedy answers to every session step, then runs the
sekv server (tiny host and NVMe budgets, the NVMe folder on a small tmpfs
where it can mount one) through `--faults` seeded faults. Writes
`summary.json` (`{"commit", "seed", "faults_injected", "faults_by_kind",
"kills", "restarts", "requests", "wrong_tokens", "engine_crashes",
"failed_startups", "restored_after_restart_tokens", ...}`), `report.md` with
the command, and `run.log`.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
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
    p.add_argument("--out", default="benchmarks/results/faults")
    p.add_argument("--model", default=None, help="model folder (default: the bundled SmolLM2)")
    args = p.parse_args(argv)
    from vllm_sekv.essays import essay_text
    from vllm_sekv.models import prepare_model

    model = args.model or str(prepare_model(quiet=True))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_file = open(out / "run.log", "w")

    def log(line: str) -> None:
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    steps = sessions(essay_text(max_chars=200_000))
    work = Path(tempfile.mkdtemp(prefix="sekv-faults-"))
    # The servers run a copy of the package as it is now: edits during a long run never reach a restart.
    code = work / "code"
    shutil.copytree(Path(__file__).resolve().parents[2] / "vllm_sekv", code / "vllm_sekv")
    shutil.copytree(Path(__file__).resolve().parents[2] / "triton_kernels", code / "vllm_sekv" / "triton_kernels")
    env = {**ENV, "PYTHONPATH": str(code)}
    run = FaultRun(model, work, args.seed, VLLM_ARGS, env, SEKV, log=log)
    t0 = time.time()
    try:
        run.compute_reference([s for session in steps for s in session])
        counters = run.run(args.faults, steps, args.requests_per_fault, max_kills=args.max_kills)
    finally:
        run.close()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    summary = {"commit": commit, "seed": args.seed, **counters.summary(),
               "seconds": round(time.time() - t0), "tmpfs": run.tmpfs}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    command = "python benchmarks/faults/run.py " + " ".join(argv if argv is not None else sys.argv[1:])
    rows = "\n".join(f"| {k} | {v} |" for k, v in summary.items() if k != "faults_by_kind")
    kinds = "\n".join(f"| {k} | {v} |" for k, v in summary["faults_by_kind"].items())
    (out / "report.md").write_text(
        f"# Fault injection\n\nSmolLM2-135M-Instruct (float32) through real `vllm serve` with sekv: host tier "
        f"{SEKV['host_bytes']}, NVMe tier {SEKV['nvme_bytes']} on a small tmpfs; every answer compared token by "
        f"token with plain vLLM's greedy answer to the same prompt.\n\n"
        f"`{command}` (commit {commit}, {platform.processor() or platform.machine()}, "
        f"{datetime.date.today().isoformat()}, {summary['seconds']} s)\n\n"
        f"| figure | value |\n|---|---|\n{rows}\n\n| fault | injected |\n|---|---|\n{kinds}\n")
    log(json.dumps(summary))
    return 0 if summary["wrong_tokens"] == summary["engine_crashes"] == summary["failed_startups"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
