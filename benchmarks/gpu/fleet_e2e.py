"""A fleet of agents at once: concurrent sessions on one device whose KV cache
cannot hold them all, served by plain vLLM (its prefix cache only), vLLM's
native `OffloadingConnector` and sekv (`sekv`: the exact workspace, `sekv-fp8`:
`workspace_codec` fp8; `sekv-views`, `sekv-fp8-views`: the same, each step
served from an execution view of at most `--view-tokens`), each engine with
the same host bytes.

    python benchmarks/gpu/fleet_e2e.py --engines plain native sekv sekv-views --sessions 16 \\
        --first-tokens 16384 --step-tokens 2048 --steps 4 [--view-tokens 8192] \\
        [--out benchmarks/results/fleet/report]

Every session starts from a history of its own (`--first-tokens` random token
ids) and takes `--steps` steps; a step sends the whole history and
`--step-tokens` new tokens (a tool result), generates `--decode-tokens`
tokens, and the session then waits a tool pause (uniform in `--pause-s`)
before its next step. All sessions run at once, started a random fraction of
a pause apart. The device's KV cache is capped at `--gpu-cache-tokens`
(vLLM's `num_gpu_blocks_override`), fewer than the sessions hold together,
so between a session's steps the others push its history out of it: plain
vLLM prefills it again, native offloading and sekv restore it from host
memory. Engines run one after the other, each in its own process, on the
Llama-3.1-8B geometry with dummy weights (`restore_e2e.model_folder`) unless
`--model` names a model folder.

Reported per engine, over the later steps (a session's first step prefills
its history on every engine and is not counted): steps per second and
generated tokens per second (from the first counted step's start to the last
one's end), p50 / p99 time to first token, and the peak device memory
(`nvidia-smi`, the whole device) and host memory (resident set of the
engine's processes) sampled every half second; and where the time went:
the engine's own steps over that span (one sample per forward, through a
vLLM stat logger), their mean length, the mean number of requests running
and waiting, and the connector's figures summed (sekv: restored tokens,
restore milliseconds, captured tokens). Each engine first serves one short
request, so that no engine's timed steps pay its kernels' first
compilation. With `--timers`, the engine core's host time per engine step,
by vLLM and sekv method (`host_timers.py`), over the same span; with
`--profile-steps FIRST COUNT`, the device time per engine step by kernel and
copy over COUNT engine steps from step FIRST (`step_profile.py`). Each engine
has `--start-timeout-s` to start and then `--timeout-s` to serve the fleet.
With `--run-dir DIR` the engines of one comparison may run over several
invocations (one device call each, where an engine at full scale takes
minutes): DIR keeps the workload, which each invocation must repeat, and
every engine's row, and the report covers them all. Writes OUT.json (every
step of every session) and OUT.md, headed by machine, commit and command(s),
and `summary.json` beside them: `{"machine", "commit", "rows": [{"engine",
"codec", "sessions", "steps_per_s", "tokens_per_s", "ttft_p50_s",
"ttft_p99_s"}]}`.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import report_header as H  # noqa: E402
from restore_e2e import model_folder  # noqa: E402

TITLE = "A fleet of agents: concurrent sessions on a KV cache too small for them all"
ENGINES = ("plain", "native", "sekv", "sekv-fp8", "sekv-views", "sekv-fp8-views")


def engine_main(spec: dict) -> None:
    """One engine in this process: every session at once; the steps to spec["out"]."""
    import asyncio
    import random

    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM

    transfer = kv_transfer_config(spec["engine"], spec["host_bytes"], spec["view_tokens"])
    kwargs = {"kv_transfer_config": transfer} if transfer else {}
    from vllm.v1.metrics.loggers import StatLoggerBase

    samples: list[dict] = []

    class EngineSamples(StatLoggerBase):
        """One sample per engine step that produced outputs: when, how many
        requests ran and waited, and the connector's own figures of the step."""

        def __init__(self, vllm_config, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats, iteration_stats, *args, **kwargs) -> None:
            if scheduler_stats is None:
                return
            connector = getattr(scheduler_stats, "kv_connector_stats", None) or {}
            samples.append({"t": time.perf_counter(), "running": scheduler_stats.num_running_reqs,
                            "waiting": scheduler_stats.num_waiting_reqs,
                            "connector": {k: v for k, v in connector.items() if isinstance(v, (int, float))}})

        def log_engine_initialized(self) -> None:
            pass

    dummy = spec["load_format"] == "dummy"
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=spec["model_dir"], load_format=spec["load_format"], skip_tokenizer_init=dummy, enforce_eager=True,
        max_model_len=spec["max_model_len"], gpu_memory_utilization=spec["gpu_memory_utilization"],
        num_gpu_blocks_override=spec["gpu_blocks"], enable_prefix_caching=True, seed=0, **kwargs),
        stat_loggers=[EngineSamples])
    Path(spec["out"]).with_suffix(".up").touch()  # started: the run's own time limit begins
    params = SamplingParams(max_tokens=spec["decode_tokens"], temperature=0.0, ignore_eos=True,
                            detokenize=not dummy)
    lo, hi = 1000, spec["vocab_size"] - 1000
    steps: list[dict] = []

    async def session(i: int) -> None:
        rng = random.Random(f"session-{i}")
        history = [rng.randrange(lo, hi) for _ in range(spec["first_tokens"])]
        await asyncio.sleep(rng.uniform(0, spec["pause_s"][1]))
        for step in range(spec["steps"]):
            prompt = history + [rng.randrange(lo, hi) for _ in range(spec["step_tokens"])]
            start, first, out = time.perf_counter(), None, None
            async for out in engine.generate(TokensPrompt(prompt_token_ids=prompt), params,
                                             request_id=f"{spec['engine']}-{i}-{step}"):
                if first is None and out.outputs[0].token_ids:
                    first = time.perf_counter()
            end = time.perf_counter()
            generated = list(out.outputs[0].token_ids)
            steps.append({"session": i, "step": step, "prompt_tokens": len(prompt), "generated_tokens": len(generated),
                          "cached_tokens": out.num_cached_tokens, "start_s": start, "end_s": end,
                          "ttft_s": (first or end) - start})
            history = prompt + generated
            await asyncio.sleep(rng.uniform(*spec["pause_s"]))

    async def warm_up() -> None:
        """One short request first, so that no engine's timed steps pay its kernels' first compilation."""
        prompt = [lo + i for i in range(min(1024, spec["first_tokens"]))]
        async for _ in engine.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id="warm-up"):
            pass

    async def fleet() -> None:
        await warm_up()
        samples.clear()
        await asyncio.gather(*(session(i) for i in range(spec["sessions"])))

    t0 = time.perf_counter()
    asyncio.run(fleet())
    print(f"[{spec['engine']}] {len(steps)} steps in {time.perf_counter() - t0:.1f} s", flush=True)
    engine.shutdown()
    Path(spec["out"]).write_text(json.dumps({"steps": steps, "samples": samples}))


class PeakMemory:
    """Peak device memory (nvidia-smi; None without it) and peak resident host
    memory of a process and its children, sampled every `period_s`."""

    def __init__(self, pid: int, period_s: float = 0.5) -> None:
        self.pid, self.period_s = pid, period_s
        self.gpu_bytes: int | None = None
        self.host_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(self.period_s):
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
                self.host_bytes = max(self.host_bytes, sum(p.memory_info().rss for p in procs))
            except psutil.Error:
                pass
            try:
                used = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                      capture_output=True, text=True, timeout=10).stdout.split()
                self.gpu_bytes = max(self.gpu_bytes or 0, int(used[0]) << 20)
            except (OSError, subprocess.SubprocessError, IndexError, ValueError):
                pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def wait_engine(proc: subprocess.Popen, up: Path, start_s: float, run_s: float) -> int | str:
    """The engine process's exit code, or "timeout": it has `start_s` to start
    (a machine's first engine compiles kernels for minutes) and then `run_s`
    to serve the fleet. At a limit its whole process group is killed: the
    next engine needs the device memory its engine core holds."""
    deadline, started = time.monotonic() + start_s, False
    while proc.poll() is None:
        if not started and up.exists():
            deadline, started = time.monotonic() + run_s, True
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return "timeout"
        time.sleep(0.5)
    return proc.returncode


def run_engine(spec: dict, workdir: Path) -> dict | None:
    """Run one engine in its own process; its row, or None if it failed."""
    path = workdir / f"{spec['engine']}.json"
    spec = {**spec, "out": str(path.with_suffix(".steps.json"))}
    path.write_text(json.dumps(spec))
    env = observed_env(spec, workdir) if spec.get("timers") or spec.get("profile") else None
    proc = subprocess.Popen([sys.executable, __file__, "--engine-spec", str(path)], env=env, start_new_session=True)
    memory = PeakMemory(proc.pid)
    rc = wait_engine(proc, Path(spec["out"]).with_suffix(".up"), spec["start_timeout_s"], spec["timeout_s"])
    memory.stop()
    if rc != 0:
        print(f"engine {spec['engine']} failed: {rc}", flush=True)
        return None
    measured = json.loads(Path(spec["out"]).read_text())
    row = summarize(spec, measured["steps"], measured["samples"], memory)
    if spec.get("timers"):
        row["host_ms_per_step"] = host_time(spec["timers"], row)
    if spec.get("profile"):
        import step_profile

        profile = step_profile.read(spec["profile"].rsplit(":", 2)[0])
        if profile is None:
            print(f"engine {spec['engine']}: no device profile (fewer engine steps than profiled?)", flush=True)
        else:
            row["device_ms_per_step"] = {"steps": profile["steps"],
                                         "total": round(profile["device_ms"] / profile["steps"], 3),
                                         "ops": {o["name"]: round(o["device_ms"] / profile["steps"], 3)
                                                 for o in profile["ops"]}}
    return row


SITECUSTOMIZE = """# fleet_e2e.py --timers / --profile-steps: every Python process of the engine (the
# engine core and its workers too, forked or spawned) times vLLM's and sekv's
# methods, and the engine core profiles the device over a stretch of steps.
import os, sys
sys.path.insert(0, {gpu_dir!r})
try:
    if os.environ.get("FLEET_TIMERS"):
        import host_timers
        host_timers.install(quiet=True)
        host_timers.dump_every(os.environ["FLEET_TIMERS"])
    if os.environ.get("FLEET_PROFILE"):
        import step_profile
        prefix, first, steps = os.environ["FLEET_PROFILE"].rsplit(":", 2)
        step_profile.install(prefix, int(first), int(steps))
except Exception as e:  # the engine runs unobserved
    print(f"fleet observers: not installed in process {{os.getpid()}}: {{e!r}}", file=sys.stderr)
"""


def observed_env(spec: dict, workdir: Path) -> dict:
    """The environment of an engine whose processes dump their host timers
    (`spec["timers"]`: a prefix) and profile a stretch of steps
    (`spec["profile"]`: "prefix:first:steps"): a `sitecustomize` module first
    on PYTHONPATH, which Python runs at every interpreter's start."""
    site = workdir / "observers_site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(gpu_dir=str(Path(__file__).resolve().parent)))
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "FLEET_TIMERS": spec.get("timers") or "", "FLEET_PROFILE": spec.get("profile") or "",
            "PYTHONPATH": f"{site}:{path}" if path else str(site)}


def host_time(prefix: str, row: dict) -> dict[str, dict] | None:
    """The engine's host time per engine step over the counted span, by
    method (`host_timers`: wall time inside each, a nested call in its
    caller's too), summed over the processes that dumped them (the engine
    core; on CPU also its worker)."""
    import host_timers

    steps = [s for s in row["steps"] if s["step"] > 0]
    begin, end = min(s["start_s"] for s in steps), max(s["end_s"] for s in steps)
    total: dict[str, dict] = {}
    for lines in host_timers.read_dumps(prefix).values():
        around = host_timers.sums_between(lines, begin, end)
        for label, t in (host_timers.diff(*around) if around else {}).items():
            into = total.setdefault(label, {"calls": 0.0, "ms": 0.0})
            into["calls"] += t["calls"]
            into["ms"] += t["ms"]
    step = total.get("engine.step") or total.get("engine.step_with_batch_queue")
    if not step:
        print(f"host timers: no engine steps in the dumps under {prefix} (an engine core started by spawn?)",
              flush=True)
        return None
    return {k: {"calls": round(v["calls"] / step["calls"], 2), "ms": round(v["ms"] / step["calls"], 3)}
            for k, v in sorted(total.items(), key=lambda kv: -kv[1]["ms"])}


def kv_transfer_config(engine: str, host_bytes: int, view_tokens: int) -> dict | None:
    """vLLM's `kv_transfer_config` for an engine name (None: plain vLLM)."""
    if engine == "native":
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": host_bytes}}
    if not engine.startswith("sekv"):
        return None
    extra = {"host_bytes": host_bytes, "workspace_codec": codec_of(engine)}
    if engine.endswith("-views"):
        extra["view_tokens"] = view_tokens
    return {"kv_connector": "sekv", "kv_role": "kv_both", "kv_connector_extra_config": extra}


def codec_of(engine: str) -> str:
    """The workspace codec of an engine name: `sekv` exact, `sekv-fp8` fp8 (with or without `-views`), `-` for
    the others."""
    if not engine.startswith("sekv"):
        return "-"
    return "fp8" if "-fp8" in engine else "exact"


def summary_engine(engine: str) -> str:
    """An engine's name in `summary.json`, whose rows carry the codec apart: `sekv-fp8-views` is `sekv-views`
    with codec fp8."""
    return engine.replace("-fp8", "")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summarize(spec: dict, steps: list[dict], samples: list[dict], memory: PeakMemory) -> dict:
    counted = [s for s in steps if s["step"] > 0]
    begin, end = min(s["start_s"] for s in counted), max(s["end_s"] for s in counted)
    span = end - begin
    ttfts = [s["ttft_s"] for s in counted]
    window = [x for x in samples if begin <= x["t"] <= end]
    connector: dict[str, float] = {}
    for x in window:
        for k, v in x["connector"].items():
            connector[k] = connector.get(k, 0) + v
    return {
        "engine": spec["engine"], "codec": codec_of(spec["engine"]),
        "sessions": spec["sessions"], "steps_counted": len(counted),
        "steps_per_s": round(len(counted) / span, 4),
        "tokens_per_s": round(sum(s["generated_tokens"] for s in counted) / span, 2),
        "ttft_p50_s": round(percentile(ttfts, 50), 4), "ttft_p99_s": round(percentile(ttfts, 99), 4),
        "cached_share": round(sum(s["cached_tokens"] for s in counted) / sum(s["prompt_tokens"] for s in counted), 4),
        "gpu_peak_gib": None if memory.gpu_bytes is None else round(memory.gpu_bytes / 2**30, 2),
        "host_peak_gib": round(memory.host_bytes / 2**30, 2),
        "engine_steps": len(window),
        "engine_step_ms": round(1000 * span / len(window), 2) if window else None,
        "running_mean": round(sum(x["running"] for x in window) / len(window), 2) if window else None,
        "waiting_mean": round(sum(x["waiting"] for x in window) / len(window), 2) if window else None,
        "connector": connector,
        "steps": steps,
    }


def report(rows: list[dict], args: argparse.Namespace, out: Path, commands: list[str]) -> None:
    meta = H.meta(commands)
    held = args.sessions * (args.first_tokens + args.steps * (args.step_tokens + args.decode_tokens))
    lines = [
        *H.header_from(meta, TITLE),
        f"{args.sessions} sessions at once, each from a {args.first_tokens}-token history, {args.steps} steps of "
        f"{args.step_tokens} new tokens and {args.decode_tokens} generated, a tool pause of "
        f"{args.pause_s[0]}-{args.pause_s[1]} s between steps; the sessions end holding {held} tokens together, "
        f"the device's KV cache holds {args.gpu_cache_tokens}; host bytes per engine: {args.host_bytes}. "
        "Over the steps after each session's first; `cached`: the share of their prompt tokens vLLM did not "
        "compute (its prefix cache or a connector's restore).",
        *([] if not any(r["engine"].endswith("-views") for r in rows) else [
            "", f"The `-views` engines serve every step whose prompt is longer than {args.view_tokens} tokens from "
            f"an execution view of at most that many: the history blocks the step's new tokens score highest, "
            "restored, so a running request holds at most a view's KV on the device. A view is lossy: which "
            "history it keeps, and what that costs in answers, is the fidelity evaluation's subject "
            "(`benchmarks/results/fidelity/`); this benchmark counts time and memory only. vLLM counts a "
            "view step's cached tokens on its first pass, not on the prompt: their `cached` is left out."]),
        "",
        "| engine | steps/s | generated tokens/s | TTFT p50 | TTFT p99 | cached | device GiB (peak) | host GiB (peak) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gpu = "-" if r["gpu_peak_gib"] is None else f"{r['gpu_peak_gib']:.1f}"
        cached = "-" if r["engine"].endswith("-views") else f"{r['cached_share']:.2f}"
        lines.append(f"| {r['engine']} | {r['steps_per_s']:.3f} | {r['tokens_per_s']:.1f} | {r['ttft_p50_s']:.3f} s | "
                     f"{r['ttft_p99_s']:.3f} s | {cached} | {gpu} | {r['host_peak_gib']:.1f} |")
    lines += ["", "Where the time went, over the same span: the engine's steps (each a forward of the running "
              "batch), their mean length, and how many requests ran and waited per step on average.", "",
              "| engine | engine steps | ms per engine step | running | waiting |", "|---|---|---|---|---|"]
    for r in rows:
        if r.get("engine_steps"):
            lines.append(f"| {r['engine']} | {r['engine_steps']} | {r['engine_step_ms']:.1f} | "
                         f"{r['running_mean']:.2f} | {r['waiting_mean']:.2f} |")
    timed = [r for r in rows if r.get("host_ms_per_step")]
    if timed:
        labels = list(dict.fromkeys(k for r in timed for k in list(r["host_ms_per_step"])[:12]))
        lines += ["", "Host time per engine step in the engine's processes, by method (`--timers`, "
                  "`benchmarks/gpu/host_timers.py`; a nested call counts in its caller's line too), ms:", "",
                  "| method | " + " | ".join(r["engine"] for r in timed) + " |",
                  "|---|" + "---|" * len(timed)]
        for label in labels:
            cells = [r["host_ms_per_step"].get(label, {}).get("ms") for r in timed]
            lines.append(f"| {label} | " + " | ".join("-" if c is None else f"{c:.2f}" for c in cells) + " |")
    profiled = [r for r in rows if r.get("device_ms_per_step")]
    if profiled:
        labels = list(dict.fromkeys(k for r in profiled for k in list(r["device_ms_per_step"]["ops"])[:10]))
        lines += ["", f"Device time per engine step, by kernel and copy (`--profile-steps`: PyTorch's profiler "
                  f"over {profiled[0]['device_ms_per_step']['steps']} engine steps from step "
                  f"{args.profile_steps[0]}, `benchmarks/gpu/step_profile.py`; the profiler slows the host, "
                  "not the device), ms:", "",
                  "| kernel or copy | " + " | ".join(r["engine"] for r in profiled) + " |",
                  "|---|" + "---|" * len(profiled),
                  "| all | " + " | ".join(f"{r['device_ms_per_step']['total']:.2f}" for r in profiled) + " |"]
        for label in labels:
            cells = [r["device_ms_per_step"]["ops"].get(label) for r in profiled]
            name = label if len(label) <= 90 else label[:87] + "..."
            lines.append(f"| `{name}` | " + " | ".join("-" if c is None else f"{c:.3f}" for c in cells) + " |")
    figures = [f"- {r['engine']}: " + ", ".join(f"{k} {v:g}" for k, v in sorted(r["connector"].items()) if v)
               for r in rows if any(r.get("connector", {}).values())]
    if figures:
        lines += ["", "The connectors' own figures over the span (summed over the engine's steps):", "", *figures]
    by = {r["engine"]: r for r in rows}
    for name in (e for e in ENGINES if e.startswith("sekv")):
        if name in by and "native" in by:
            s, n = by[name], by["native"]
            lines += ["", f"{name} against native offloading, measured in this run: throughput "
                      f"{s['steps_per_s'] / n['steps_per_s']:.2f}x, p99 time to first token "
                      f"{s['ttft_p99_s'] / n['ttft_p99_s']:.2f}x."]
    out.parent.mkdir(parents=True, exist_ok=True)
    H.write_report(out.with_suffix(".md"), lines)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    summary = [{"engine": summary_engine(r["engine"]),
                **{k: r[k] for k in ("codec", "sessions", "steps_per_s", "tokens_per_s", "ttft_p50_s", "ttft_p99_s")}}
               for r in rows]
    (out.parent / "summary.json").write_text(json.dumps(
        {"machine": meta["machine"], "commit": meta["commit"], "rows": summary}, indent=1) + "\n")
    print("\n".join(lines), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-spec", help=argparse.SUPPRESS)
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    ap.add_argument("--model", help="a model folder (default: Llama-3.1-8B geometry, dummy weights)")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--first-tokens", type=int, default=16384)
    ap.add_argument("--step-tokens", type=int, default=2048)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--pause-s", type=float, nargs=2, default=[0.5, 2.0], metavar=("LO", "HI"))
    ap.add_argument("--gpu-cache-tokens", type=int, default=98304)
    ap.add_argument("--view-tokens", type=int, default=8192,
                    help="the `-views` engines' view budget: a step whose prompt is longer is served from a view")
    ap.add_argument("--block-size", type=int, default=16, help="vLLM's KV page on this device (CPUs: 128)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--host-bytes", default="64G", help="sekv's host_bytes; native offloading gets as many")
    ap.add_argument("--timeout-s", type=int, default=560, help="each engine's limit once started")
    ap.add_argument("--start-timeout-s", type=int, default=300,
                    help="each engine's limit to start (a machine's first one compiles kernels)")
    ap.add_argument("--timers", action="store_true",
                    help="time the engine core's vLLM and sekv methods (benchmarks/gpu/host_timers.py)")
    ap.add_argument("--profile-steps", type=int, nargs=2, metavar=("FIRST", "COUNT"),
                    help="profile the device over COUNT engine steps from step FIRST (benchmarks/gpu/step_profile.py)")
    ap.add_argument("--out", default=str(H.results_dir("fleet") / "report"), help="writes OUT.json and OUT.md")
    ap.add_argument("--run-dir", help="a folder that keeps the workload, commands and rows of one comparison "
                    "whose engines run over several invocations (the report covers them all)")
    args = ap.parse_args()
    if args.engine_spec:
        engine_main(json.loads(Path(args.engine_spec).read_text()))
        return
    from vllm_sekv.config_values import parse_size_bytes

    workdir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="fleet_e2e_"))
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir, load_format, vocab = model_folder(args.model, workdir)
    longest = args.first_tokens + args.steps * (args.step_tokens + args.decode_tokens)
    base = {"model_dir": str(model_dir), "load_format": load_format, "vocab_size": vocab,
            "sessions": args.sessions, "first_tokens": args.first_tokens, "step_tokens": args.step_tokens,
            "decode_tokens": args.decode_tokens, "steps": args.steps, "pause_s": args.pause_s,
            "max_model_len": longest + 64, "view_tokens": args.view_tokens,
            "gpu_blocks": -(-args.gpu_cache_tokens // args.block_size),
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "host_bytes": parse_size_bytes("host_bytes", args.host_bytes), "timeout_s": args.timeout_s,
            "start_timeout_s": args.start_timeout_s}
    rows, commands = RunDir(workdir).join(base, H.command(__file__)) if args.run_dir else ([], [H.command(__file__)])
    for engine in args.engines:  # the report after each engine: a run cut short keeps what it measured
        timers = str(workdir / f"timers-{engine}") if args.timers else None
        profile = f"{workdir / f'profile-{engine}'}:{args.profile_steps[0]}:{args.profile_steps[1]}" \
            if args.profile_steps else None
        if row := run_engine({**base, "engine": engine, "timers": timers, "profile": profile}, workdir):
            rows = [r for r in rows if r["engine"] != engine] + [row]
            if args.run_dir:
                RunDir(workdir).keep(row)
            report(rows, args, Path(args.out), commands)


class RunDir:
    """One comparison's engines measured over several invocations (`--run-dir`,
    e.g. one device call each): the folder keeps the workload, which every
    invocation must repeat, the commands, and each engine's row."""

    # what may differ between invocations: how long an engine may take, and the
    # share of device memory it may ask for (its KV cache is sized by tokens)
    FREE = ("timeout_s", "start_timeout_s", "gpu_memory_utilization")

    def __init__(self, path: Path) -> None:
        self.workload, self.commands, self.rows = path / "workload.json", path / "commands.txt", path / "rows.jsonl"

    def join(self, base: dict, command: str) -> tuple[list[dict], list[str]]:
        """The rows and commands so far, this invocation's command added; exits
        if `base` is not the folder's workload."""
        workload = {k: v for k, v in base.items() if k not in self.FREE}
        if self.workload.exists():
            kept = json.loads(self.workload.read_text())
            differ = sorted(k for k in {*kept, *workload} if kept.get(k) != workload.get(k))
            if differ:
                sys.exit(f"--run-dir {self.workload.parent}: this invocation's workload differs in {', '.join(differ)}")
        else:
            self.workload.write_text(json.dumps(workload))
        with self.commands.open("a") as f:
            f.write(command + "\n")
        rows: dict[str, dict] = {}
        if self.rows.exists():
            for line in self.rows.read_text().splitlines():
                row = json.loads(line)
                rows.pop(row["engine"], None)
                rows[row["engine"]] = row  # measured again: the latest row, in its place in the order
        return list(rows.values()), self.commands.read_text().splitlines()

    def keep(self, row: dict) -> None:
        with self.rows.open("a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
