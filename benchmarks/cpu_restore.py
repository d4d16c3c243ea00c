"""CPU benchmark: time to first token of a follow-up agent step after vLLM's
prefix cache was reset — sekv restoring the history from host memory, sekv
restoring it from the NVMe tier, and plain vLLM prefilling it again. Real vLLM
engine, SmolLM2-135M, real essay text.

    python benchmarks/cpu_restore.py [--histories 1024 2048 4096 7168] [--repeats 3]

For each history length H: step 1 sends H tokens of essay (sekv captures them),
then the cache is reset and step 2 sends the same H tokens + step 1's output +
64 new tokens with max_tokens=1; its wall time is the time to first token. In
the NVMe mode, two filler requests of other text push the history out of the
host tier first (it is then read back from disk, checksums verified, before
the restore). All engines run in the same invocation (one child process each,
one after the other) with the same token ids. Writes
benchmarks/results/cpu_restore/report.{json,md}, the Markdown headed by the
machine, commit and command; `--report-only` writes the Markdown again from
the JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import report_header as H

RESULTS = H.results_dir("cpu_restore")
NEW_TOKENS = 64
TITLE = "Follow-up step after a GPU-cache reset: sekv restore (host, NVMe) vs plain re-prefill (CPU)"


def child(mode: str, histories: list[int], repeats: int, out_path: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_sekv.calibration_corpus import essay_text
    from vllm_sekv.models import prepare_model

    kwargs = {}
    nvme_dir = None
    if mode == "sekv":
        extra = {"host_bytes": "4G"}
    elif mode == "nvme":
        nvme_dir = tempfile.mkdtemp(prefix="sekv-bench-nvme-", dir=os.environ.get("SEKV_BENCH_NVME_DIR"))
        extra = {"host_bytes": "256M", "nvme_dir": nvme_dir, "nvme_bytes": "8G"}
    if mode != "plain":
        kwargs["kv_transfer_config"] = {"kv_connector": "sekv", "kv_role": "kv_both",
                                        "kv_connector_extra_config": extra}
    llm = LLM(model=str(prepare_model(quiet=True)), max_model_len=8192, enforce_eager=True,
              gpu_memory_utilization=0.5, **kwargs)
    corpus = llm.get_tokenizer().encode(essay_text(), add_special_tokens=False)  # ~150K tokens
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=corpus[:256])], one, use_tqdm=False)  # warm-up
    rows = []
    for h in histories:
        for r in range(repeats):
            start = 9000 * r + h  # a different stretch of text each repeat, never seen before
            history = corpus[start : start + h]
            new = corpus[start + h + 1000 : start + h + 1000 + NEW_TOKENS]
            llm.reset_prefix_cache()
            first = llm.generate([TokensPrompt(prompt_token_ids=history)], one, use_tqdm=False)[0]
            follow_up = history + list(first.outputs[0].token_ids) + new
            if mode == "nvme":  # push the history out of the host tier (256M: ~11K tokens)
                for k in range(2):  # text from the far end of the corpus, never the history
                    far = len(corpus) - 7000 * (k + 1) - 14_000 * r
                    llm.generate([TokensPrompt(prompt_token_ids=corpus[far : far + 7000])], one,
                                 use_tqdm=False)
            llm.reset_prefix_cache()
            t0 = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=follow_up)], one, use_tqdm=False)[0]
            ttft_s = time.perf_counter() - t0
            params = (out.kv_transfer_params or {}).get("sekv", {})
            rows.append({"history_tokens": h, "repeat": r, "prompt_tokens": len(follow_up),
                         "cached_tokens": out.num_cached_tokens, "ttft_s": ttft_s,
                         "restore_ms": params.get("restore_ms"),
                         "restored_by_tier": params.get("restored_tokens")})
            print(f"[{mode}] H={h} r={r} ttft={ttft_s*1000:.0f} ms cached={out.num_cached_tokens}", flush=True)
    Path(out_path).write_text(json.dumps(rows))
    if nvme_dir:
        shutil.rmtree(nvme_dir, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--histories", type=int, nargs="+", default=[1024, 2048, 4096, 7168])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", choices=["plain", "sekv", "nvme"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--report-only", action="store_true", help="only write report.md again from report.json")
    args = ap.parse_args()
    if args.child:
        child(args.child, args.histories, args.repeats, args.out)
        return
    if args.report_only:
        write_report(json.loads((RESULTS / "report.json").read_text()))
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    runs = {}
    for mode in ("plain", "sekv", "nvme"):
        out = RESULTS / f".cpu_restore_{mode}.tmp.json"  # kept until the tables are written
        subprocess.run([sys.executable, __file__, "--child", mode, "--out", str(out),
                        "--repeats", str(args.repeats), "--histories", *map(str, args.histories)],
                       check=True)
        runs[mode] = json.loads(out.read_text())
    table = []
    for h in args.histories:
        med = {m: statistics.median(r["ttft_s"] for r in runs[m] if r["history_tokens"] == h) for m in runs}
        restored = [r["cached_tokens"] for r in runs["sekv"] if r["history_tokens"] == h]
        restore_ms = [r["restore_ms"] for r in runs["sekv"] if r["history_tokens"] == h]
        from_nvme = [r["restored_by_tier"]["nvme"] for r in runs["nvme"] if r["history_tokens"] == h]
        table.append({"history_tokens": h, "plain_ttft_ms": round(1000 * med["plain"], 1),
                      "sekv_ttft_ms": round(1000 * med["sekv"], 1),
                      "speedup": round(med["plain"] / med["sekv"], 2),
                      "nvme_ttft_ms": round(1000 * med["nvme"], 1),
                      "nvme_speedup": round(med["plain"] / med["nvme"], 2),
                      "sekv_restored_tokens": min(restored),
                      "nvme_restored_tokens": min(from_nvme),
                      "sekv_restore_ms_median": round(statistics.median(restore_ms), 1)})
    command = H.command(__file__)
    meta = {**H.meta(command), "command": command, "model": "SmolLM2-135M-Instruct (bf16)",
            "new_tokens_per_step": NEW_TOKENS, "repeats": args.repeats}
    for mode in runs:
        (RESULTS / f".cpu_restore_{mode}.tmp.json").unlink(missing_ok=True)
    data = {"meta": meta, "table": table, "runs": runs}
    (RESULTS / "report.json").write_text(json.dumps(data, indent=1))
    write_report(data)


def write_report(data: dict) -> None:
    meta, table = data["meta"], data["table"]
    lines = [*H.header_from(meta, TITLE),
             f"{meta['model']}, {meta['new_tokens_per_step']} new tokens per step, time to first token: "
             f"median of {meta['repeats']}.", "",
             "| history tokens | plain re-prefill TTFT (ms) | sekv from host TTFT (ms) | speed-up | "
             "sekv from NVMe TTFT (ms) | speed-up | restored (host / NVMe) | host restore (ms) |",
             "|---|---|---|---|---|---|---|---|"]
    for row in table:
        lines.append(f"| {row['history_tokens']} | {row['plain_ttft_ms']} | {row['sekv_ttft_ms']} | "
                     f"{row['speedup']}x | {row['nvme_ttft_ms']} | {row['nvme_speedup']}x | "
                     f"{row['sekv_restored_tokens']} / {row['nvme_restored_tokens']} | "
                     f"{row['sekv_restore_ms_median']} |")
    H.write_report(RESULTS / "report.md", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
