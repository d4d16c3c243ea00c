"""Time to first token of a follow-up step after the GPU prefix cache was reset,
inside real vLLM on the GPU machine (Llama-3.1-8B geometry, dummy weights, bf16).

    python benchmarks/gpu/restore_e2e.py --engines plain native warm sekv-host sekv-batched sekv-disk \
        --lengths 8192 32768 65536 130944 [--out benchmarks/results/gpu_restore/report]

For each history length L an agent step is simulated: the history (L random
token ids) is prefilled once (max_tokens=1), vLLM's GPU prefix cache is reset,
then the follow-up step (the same history + 64 new tokens, max_tokens=1) is
timed; the median of `--repeats` resets is reported. Engines, each in its own
process, one after the other, in this one invocation:

* `plain`      vLLM re-prefills the whole history;
* `native`     vLLM's own `OffloadingConnector` (CPU offload, `--native-cpu-gib`);
* `sekv-host`  sekv restores the history from its pinned host tier
               (`restore_mode` auto: layer by layer, behind the forward pass);
* `sekv-batched` the same with `restore_mode` batched (every layer of a batch
               of blocks at once, all before the forward pass);
* `sekv-disk`  sekv restores it from its NVMe tier: the history is captured and
               written by one engine, which then exits; a fresh engine on the same
               folder finds every block on disk (the manifest) and reads it back;
* `warm`       plain vLLM with its prefix cache NOT reset: the history is still
               in GPU memory, so the step pays only vLLM's own per-request work
               and the forward pass. No restore can beat it; a restore's TTFT
               minus this is what the restore costs.

The sekv engines run once per workspace codec of `--codecs` (default
`exact`; `fp8`: `workspace_codec` fp8, half the bytes per token).

Each repeat's new tokens are fresh (so `warm` never hits its own earlier step).
Also measured in the same run: pinned host->device copy bandwidth (1 GiB,
median of 5), which bounds any restore from host memory, and the bandwidth of
the pitched copies a layerwise restore makes (one layer of 256 consecutive
4 MiB slots per K/V copy). Writes OUT.json and OUT.md (default
benchmarks/results/gpu_restore/report), the Markdown headed by the machine,
commit and command (`benchmarks/report_header.py`), and `summary.json` beside
them: `{"machine", "commit", "rows": [{"engine", "codec", "history_tokens",
"ttft_s", "bound_s"}]}` for `plain`, `native`, `sekv-host` and `sekv-disk`
(`bound_s`: the history's bytes under the row's codec, bf16 for the others,
at the measured pinned bandwidth). No figure is estimated:
every number is measured here. `--merge A.json B.json` writes one report from
runs made apart (e.g. lengths on two machines).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import report_header as H  # noqa: E402

NEW_TOKENS = 64
TITLE = "GPU end to end: restore vs re-prefill vs vLLM's native offloading"
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "attention_bias": False,
    "mlp_bias": False, "initializer_range": 0.02,
}



def model_folder(model_dir: str | None, workdir: Path) -> tuple[str, str, int]:
    """(folder, vLLM load format, vocabulary size) of the model an end-to-end
    benchmark serves: `model_dir` with its weights, or (None) a folder under
    `workdir` holding the Llama-3.1-8B geometry for dummy weights."""
    if model_dir:
        return str(model_dir), "auto", json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    folder = workdir / "llama31-8b"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(LLAMA31_8B))
    return str(folder), "dummy", LLAMA31_8B["vocab_size"]


# The follow-up's path from submission to its restore's first copies.
TIMELINE = ["llm.add_request", "scheduler.schedule", "sekv.sched.get_num_new_matched_tokens",
            "sekv.sched.build_connector_meta", "sekv.worker.bind", "sekv.layerwise.start", "sekv.worker.start_load_kv"]


def h2d_bandwidth(gib: int = 1, repeats: int = 5) -> float:
    import torch

    src = torch.empty(gib << 30, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(gib << 30, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return (gib << 30) / statistics.median(times)


def pitched_bandwidth(repeats: int = 5) -> float:
    """Bytes/s of the layerwise restore's copies: a pinned pool of 256 slots of
    Llama-3.1-8B geometry (32-token blocks, 4 MiB each), copied layer by layer,
    K and V apart, each as one pitched copy of 256 rows of 64 KiB."""
    import torch

    from vllm_sekv.store import cudart

    pool = torch.empty((256, 2, 32, 32, 8, 128), dtype=torch.bfloat16, pin_memory=True)
    dst = torch.empty((32, 2, 256, 32, 8, 128), dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    chunk, slot = pool[0, 0, 0].numel() * 2, pool[0].numel() * 2

    def once() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for layer in range(32):
            for kv in (0, 1):
                cudart.copy2d_async(dst[layer, kv].data_ptr(), chunk, pool[0, kv, layer].data_ptr(), slot,
                                    chunk, 256, stream)
        stream.synchronize()
        return time.perf_counter() - t0

    once()
    return pool.numel() * 2 / statistics.median(once() for _ in range(repeats))


def engine_main(spec: dict) -> None:
    """One engine in this process: prefill, reset, time the follow-ups."""
    import random

    if spec.get("timers"):
        import host_timers

        print(f"host timers on: {host_timers.install()}", flush=True)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = {}
    if spec["engine"] == "native":
        kwargs["kv_transfer_config"] = {
            "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": spec["native_cpu_gib"] << 30}}
    elif spec["engine"].startswith("sekv"):
        kwargs["kv_transfer_config"] = {"kv_connector": "sekv", "kv_role": "kv_both",
                                        "kv_connector_extra_config": spec["sekv"]}
    t0 = time.perf_counter()
    llm = LLM(model=spec["model_dir"], load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
              max_model_len=max(spec["lengths"]) + NEW_TOKENS + 8, gpu_memory_utilization=0.85,
              enable_prefix_caching=True, seed=0, **kwargs)
    print(f"[{spec['engine']}] engine up in {time.perf_counter() - t0:.0f} s", flush=True)
    audit = None
    if spec.get("sync_audit"):
        import sync_audit as audit

        audit.install()  # after start-up: its synchronizations are not a step's
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def generate(ids):
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        return time.perf_counter() - t, out

    rows = []
    for length in spec["lengths"]:
        rng = random.Random(f"history-{length}")
        history = [rng.randrange(1000, 120000) for _ in range(length)]
        if spec["phase"] in ("all", "capture"):
            seconds, _ = generate(history)
            print(f"[{spec['engine']}] {length}: history prefill {seconds:.2f} s", flush=True)
        if spec["phase"] == "capture":
            continue
        times, cached, params_seen = [], [], None
        # From disk only the first follow-up reads the disk (it leaves the blocks in host memory).
        for _ in range(1 if spec["phase"] == "restore" else spec["repeats"]):
            step = history + [rng.randrange(1000, 120000) for _ in range(NEW_TOKENS)]
            if spec["engine"] != "warm":
                llm.reset_prefix_cache()
            time.sleep(0.5)  # let asynchronous offload/write-behind work settle
            before = host_timers.snapshot() if spec.get("timers") else None
            syncs_before = audit.snapshot() if audit else None
            submitted = time.perf_counter()
            seconds, out = generate(step)
            syncs = audit.diff(syncs_before, audit.snapshot()) if audit else None
            if before is not None:
                timers = host_timers.diff(before, host_timers.snapshot())
                loads = host_timers.first_end_after("connector.pre_forward", submitted)
                if loads is not None:  # the restore's first copies are enqueued by then (both connectors)
                    timers["submit_to_loads_enqueued"] = {"calls": 1, "ms": (loads - submitted) * 1e3}
                for label in TIMELINE:  # where those milliseconds went
                    end = host_timers.first_end_after(label, submitted)
                    if end is not None:
                        timers[f"submit_to_end_of {label}"] = {"calls": 1, "ms": (end - submitted) * 1e3}
            times.append(seconds)
            cached.append(out.num_cached_tokens)
            params_seen = out.kv_transfer_params
        rows.append({"engine": spec["engine"], "codec": spec.get("codec", "-"), "history_tokens": length,
                     "ttft_s": statistics.median(times),
                     "ttft_all_s": times, "num_cached_tokens": cached, "kv_transfer_params": params_seen})
        if spec.get("timers") and spec["phase"] != "capture":
            rows[-1]["timers"] = timers  # of the last repeat
        if audit and spec["phase"] != "capture":
            rows[-1]["syncs"] = syncs  # of the last repeat
        print(f"[{spec['engine']}] {length}: TTFT {statistics.median(times):.3f} s (all {times}), "
              f"cached {cached}, {params_seen}", flush=True)
    if spec["phase"] == "capture":
        wait_for_records(llm, generate, spec)
    Path(spec["out"]).write_text(json.dumps(rows))
    del llm


def wait_for_records(llm, generate, spec: dict, timeout_s: float = 240.0) -> None:
    """Blocks are written behind once committed, and a step's plan carries the
    writes of blocks committed before it: run small steps until every block of
    every history has its record on disk."""
    expected = sum(length // 32 for length in spec["lengths"])
    root = Path(spec["sekv"]["nvme_dir"])
    deadline = time.monotonic() + timeout_s
    found = 0
    while time.monotonic() < deadline:
        generate([7] * 40)  # a tiny step: carries pending writes, drains completions
        found = sum(1 for _ in root.glob("fp-*/blocks/*/*.blk"))
        if found >= expected:
            break
        time.sleep(1.0)
    print(f"[{spec['engine']}] {found} of {expected} block records on disk", flush=True)


def run_engine(spec: dict, workdir: Path) -> list[dict]:
    path = workdir / f"{spec['engine']}-{spec.get('codec', '-')}-{spec['phase']}.json"
    spec = {**spec, "out": str(path.with_suffix(".rows.json"))}
    path.write_text(json.dumps(spec))
    in_process = spec.get("timers") or spec.get("sync_audit")  # where they can watch the engine
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if in_process else None
    proc = subprocess.run([sys.executable, __file__, "--engine-spec", str(path)], timeout=spec["timeout_s"], env=env)
    if proc.returncode != 0:
        print(f"engine {spec['engine']} ({spec['phase']}) failed with {proc.returncode}", flush=True)
        return []
    return json.loads(Path(spec["out"]).read_text()) if spec["phase"] != "capture" else []


def report(rows: list[dict], bandwidth: float, pitched: float | None, args: argparse.Namespace, out: Path,
           meta: dict | None = None) -> None:
    by = {(r["engine"], r["history_tokens"]): r for r in rows if codec_of(r) in ("-", "exact")}
    kv_bytes_per_token = bytes_per_token("exact")
    meta = meta or H.meta(H.command(__file__))
    lengths = sorted({r["history_tokens"] for r in rows}) or args.lengths
    lines = [
        *H.header_from(meta, TITLE),
        f"Llama-3.1-8B geometry (32 layers, 8 KV heads, head_dim 128, bf16), dummy weights, eager; "
        f"{NEW_TOKENS} new tokens per step; time to first token of the follow-up step after vLLM's GPU "
        f"prefix cache was reset, median over resets (sekv disk: the first follow-up only; `warm`: "
        "vLLM with the history still in its GPU cache, no reset).",
        f"Pinned host->device bandwidth measured in the same run(s): {bandwidth / 1e9:.1f} GB/s"
        + (f" (pitched layer copies: {pitched / 1e9:.1f} GB/s)" if pitched else "")
        + "; the bound is the history's KV bytes at the plain bandwidth. `sekv restore` is the transfer "
        "alone (CUDA events on the copy stream, from the response's `restore_ms`); `sekv - warm` is what "
        "the restore adds to vLLM's own step.",
        "",
        "| history | plain re-prefill | native offload | sekv host (layerwise) | sekv host (batched) | "
        "sekv disk | warm | host->device bound | sekv restore | restore / bound | sekv - warm | "
        "sekv vs native | sekv vs plain | bound / sekv TTFT |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for length in lengths:
        def t(engine):
            r = by.get((engine, length))
            return None if r is None else r["ttft_s"]

        def cell(value, fmt):
            return "—" if value is None else fmt.format(value)
        bound = length * kv_bytes_per_token / bandwidth
        cells = [f"{length // 1024}K"]
        for engine in ("plain", "native", "sekv-host", "sekv-batched", "sekv-disk", "warm"):
            cells.append(cell(t(engine), "{:.3f} s"))
        cells.append(f"{bound:.3f} s")
        host_row = by.get(("sekv-host", length))
        restore_ms = ((host_row or {}).get("kv_transfer_params") or {}).get("sekv", {}).get("restore_ms")
        restore_s = None if restore_ms is None else restore_ms / 1000
        cells.append(cell(restore_s, "{:.3f} s"))
        cells.append(cell(None if restore_s is None else bound / restore_s, "{:.2f}"))
        host = t("sekv-host")
        cells.append(cell(None if host is None or t("warm") is None else host - t("warm"), "{:.3f} s"))
        cells.append(cell(None if host is None or t("native") is None else t("native") / host, "{:.2f}x"))
        cells.append(cell(None if host is None or t("plain") is None else t("plain") / host, "{:.1f}x"))
        cells.append(cell(None if host is None else bound / host, "{:.2f}"))
        lines.append("| " + " | ".join(cells) + " |")
    fp8 = {(r["engine"], r["history_tokens"]): r for r in rows if codec_of(r) == "fp8"}
    if fp8:
        lines += ["", "The fp8 workspace (`workspace_codec` fp8: float8 K/V with a scale and per-channel centres "
                  "per block, layer and KV head; the bound at its bytes per token):", "",
                  "| history | sekv host fp8 | sekv disk fp8 | fp8 bound | sekv restore fp8 | native / sekv fp8 | "
                  "sekv exact / sekv fp8 |", "|---|---|---|---|---|---|---|"]
        for length in lengths:
            host = (fp8.get(("sekv-host", length)) or {}).get("ttft_s")
            disk = (fp8.get(("sekv-disk", length)) or {}).get("ttft_s")
            restore_ms = (((fp8.get(("sekv-host", length)) or {}).get("kv_transfer_params") or {})
                          .get("sekv", {}).get("restore_ms"))
            native = (by.get(("native", length)) or {}).get("ttft_s")
            exact = (by.get(("sekv-host", length)) or {}).get("ttft_s")
            cells = [f"{length // 1024}K", "—" if host is None else f"{host:.3f} s",
                     "—" if disk is None else f"{disk:.3f} s",
                     f"{length * bytes_per_token('fp8') / bandwidth:.3f} s",
                     "—" if restore_ms is None else f"{restore_ms / 1000:.3f} s",
                     "—" if host is None or native is None else f"{native / host:.2f}x",
                     "—" if host is None or exact is None else f"{exact / host:.2f}x"]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Per engine and length: every repeat's time and vLLM's `num_cached_tokens` are in the JSON."]
    for length in lengths:
        # one column per engine and codec: a later run's row replaces an earlier one's, as in the tables above
        timed = list({(r["engine"], codec_of(r)): r for r in rows
                      if r["history_tokens"] == length and "timers" in r}.values())
        if not timed:
            continue
        labels = sorted({label for r in timed for label in r["timers"]},
                        key=lambda label: -max(r["timers"].get(label, {"ms": 0.0})["ms"] for r in timed))
        lines += ["", f"Host time of the last follow-up at {length // 1024}K (`--timers`, engine in the benchmark's "
                  "process; ms, calls in brackets; nested methods count in their callers too; "
                  "`submit_to_loads_enqueued`: from the request's submission to the end of the first "
                  "`connector.pre_forward`, where both connectors enqueue the restore's copies; `submit_to_end_of X`: "
                  "to the end of X's first call after the submission):", "",
                  "| method | " + " | ".join(r["engine"] + (" fp8" if codec_of(r) == "fp8" else "") for r in timed)
                  + " |", "|---" * (len(timed) + 1) + "|"]
        for label in labels:
            cells = [f"{r['timers'][label]['ms']:.2f} ({r['timers'][label]['calls']:.0f})" if label in r["timers"]
                     else "—" for r in timed]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for r in rows:
        if "syncs" in r:
            import sync_audit

            lines += ["", *sync_audit.table(r["syncs"], f"Synchronizations in the last follow-up, {r['engine']} at "
                                            f"{r['history_tokens'] // 1024}K (`--sync-audit`; by the innermost "
                                            "sekv frame, else vLLM frame):")]
    out.parent.mkdir(parents=True, exist_ok=True)
    H.write_report(out.with_suffix(".md"), lines)
    old = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").exists() else {}
    out.with_suffix(".json").write_text(json.dumps({
        "meta": meta, "h2d_bytes_per_s": bandwidth, "pitched_bytes_per_s": pitched, "rows": rows,
        "commands": meta["commands"],
        # runs the report's History table quotes (hand-added), kept when the report is written again
        **({"earlier_runs": old["earlier_runs"]} if old.get("earlier_runs") else {})}, indent=1))
    latest = {}  # one row per cell, a later run's in place of an earlier one's (as in the tables)
    for r in rows:
        if r["engine"] in ("plain", "native", "sekv-host", "sekv-disk"):
            latest[(r["engine"], codec_of(r), r["history_tokens"])] = r
    summary = [{"engine": r["engine"], "codec": codec_of(r), "history_tokens": r["history_tokens"],
                "ttft_s": round(r["ttft_s"], 4),
                "bound_s": round(r["history_tokens"] * bytes_per_token(codec_of(r)) / bandwidth, 4)}
               for r in latest.values()]
    (out.parent / "summary.json").write_text(json.dumps(
        {"machine": meta["machine"], "commit": meta["commit"], "rows": summary}, indent=1) + "\n")
    print("\n".join(lines), flush=True)


def codec_of(row: dict) -> str:
    """A row's workspace codec: `-` for engines without one (rows from runs
    before codecs were recorded are sekv's exact)."""
    if not row["engine"].startswith("sekv"):
        return "-"
    return row.get("codec", "exact")


def bytes_per_token(codec: str) -> float:
    """Host bytes per token of the benchmark's geometry under `codec` (bf16 for `-` and `exact`)."""
    import torch

    from vllm_sekv.config import SekvConfig
    from vllm_sekv.store.host_pool import HostPool

    block_tokens = SekvConfig().block_tokens
    return HostPool.bytes_per_block(32, block_tokens, 8, 128, torch.bfloat16,
                                    "fp8" if codec == "fp8" else "exact") / block_tokens


def merged_meta(runs: list[dict], merge_command: str) -> dict:
    """One header for runs made apart: their machines, commits and commands, then the merge (a
    single run's JSON rendered again keeps its own header)."""
    metas = [run.get("meta") or {"commands": run.get("commands", [])} for run in runs]

    def joined(key: str) -> str:
        return "; ".join(dict.fromkeys(m[key] for m in metas if m.get(key))) or "unknown"
    return {"machine": joined("machine"), "commit": joined("commit"), "date": joined("date"),
            "commands": [c for m in metas for c in m["commands"]] + ([merge_command] if len(runs) > 1 else [])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine-spec", help=argparse.SUPPRESS)
    ap.add_argument("--engines", nargs="+", default=["plain", "native", "sekv-host", "sekv-disk"])
    # 130944 ("127K"): the longest multiple of 32 whose follow-up (+ 64 tokens) fits Llama-3.1's
    # 131072-token window; a longer prompt is served from views, not restored whole
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 65536, 130944])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--native-cpu-gib", type=int, default=60)
    ap.add_argument("--host-bytes", default="48G")
    ap.add_argument("--codecs", nargs="+", choices=["exact", "fp8"], default=["exact"],
                    help="workspace codecs: each sekv engine runs once per codec")
    ap.add_argument("--nvme-dir", default="/tmp/sekv_nvme")
    ap.add_argument("--timeout-s", type=int, default=480)
    ap.add_argument("--timers", action="store_true",
                    help="engines in this process (no engine-core process), with the host time of the last "
                         "follow-up inside vLLM's and sekv's methods (host_timers.py)")
    ap.add_argument("--sync-audit", action="store_true",
                    help="count the synchronizing CUDA operations of the last follow-up, by place (sync_audit.py)")
    ap.add_argument("--out", default=str(H.results_dir("gpu_restore") / "report"),
                    help="writes OUT.json and OUT.md")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="only write the report from these runs' JSON outputs (e.g. engines run apart)")
    args = ap.parse_args()
    if args.merge:
        runs = [json.loads(Path(p).read_text()) for p in args.merge]
        rows = [r for run in runs for r in run["rows"]]
        bandwidth = min(run["h2d_bytes_per_s"] for run in runs)
        pitched = min((run["pitched_bytes_per_s"] for run in runs if run.get("pitched_bytes_per_s")), default=None)
        report(rows, bandwidth, pitched, args, Path(args.out), merged_meta(runs, H.command(__file__)))
        return
    if args.engine_spec:
        engine_main(json.loads(Path(args.engine_spec).read_text()))
        return
    workdir = Path(tempfile.mkdtemp(prefix="restore_e2e_"))
    model_dir, _, _ = model_folder(None, workdir)
    bandwidth, pitched = h2d_bandwidth(), pitched_bandwidth()
    print(f"pinned H2D: {bandwidth / 1e9:.1f} GB/s, pitched layer copies: {pitched / 1e9:.1f} GB/s", flush=True)
    base = {"model_dir": str(model_dir), "lengths": args.lengths, "repeats": args.repeats,
            "native_cpu_gib": args.native_cpu_gib, "timeout_s": args.timeout_s, "phase": "all",
            "timers": args.timers, "sync_audit": args.sync_audit}
    rows: list[dict] = []
    for engine in args.engines:
        if not engine.startswith("sekv"):
            rows += run_engine({**base, "engine": engine}, workdir)
            continue
        for codec in args.codecs:
            sekv = {"host_bytes": args.host_bytes, "workspace_codec": codec}
            if engine == "sekv-disk":
                sekv["nvme_dir"] = args.nvme_dir
                run_engine({**base, "engine": engine, "codec": codec, "sekv": sekv, "phase": "capture"}, workdir)
                rows += run_engine({**base, "engine": engine, "codec": codec, "sekv": sekv, "phase": "restore"},
                                   workdir)
                continue
            if engine == "sekv-batched":
                sekv["restore_mode"] = "batched"
            rows += run_engine({**base, "engine": engine, "codec": codec, "sekv": sekv}, workdir)
    report(rows, bandwidth, pitched, args, Path(args.out))


if __name__ == "__main__":
    main()
