"""Where an engine's host time goes: wall time spent inside named vLLM and
sekv methods, summed over a measured stretch of steps.

The engine must run in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`).
`install()` wraps each method of `TARGETS` that exists in the running vLLM
(missing ones are skipped: the list spans 0.26 and 0.32) with two
`perf_counter` reads; `snapshot()` reads the sums and `diff(a, b)` what a
stretch added. A nested call counts in both its own line and its caller's.
Calls never synchronize with the GPU, so a method's time is its host time
plus any wait for the GPU it makes itself (a device->host copy, an event).
Overhead: about a microsecond per call. `first_end_after(label, t0)` says
when a method first returned after `t0` (e.g. when a follow-up's loads were
enqueued, counted from its submission).
"""
from __future__ import annotations

import collections
import functools
import gc
import glob
import importlib
import json
import os
import time

# (label, module, class, method)
TARGETS = [
    ("engine.step", "vllm.v1.engine.core", "EngineCore", "step"),
    ("engine.step_with_batch_queue", "vllm.v1.engine.core", "EngineCore", "step_with_batch_queue"),
    ("engine.add_request", "vllm.v1.engine.core", "EngineCore", "add_request"),
    ("engine.preprocess_add_request", "vllm.v1.engine.core", "EngineCore", "preprocess_add_request"),
    ("llm.add_request", "vllm.v1.engine.llm_engine", "LLMEngine", "add_request"),
    ("llm.output_processing", "vllm.v1.engine.output_processor", "OutputProcessor", "process_outputs"),
    ("scheduler.schedule", "vllm.v1.core.sched.scheduler", "Scheduler", "schedule"),
    ("scheduler.update_from_output", "vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output"),
    ("runner.execute_model", "vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "execute_model"),
    ("runner.sample_tokens", "vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "sample_tokens"),
    ("runner.execute_model", "vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model"),
    ("runner.sample_tokens", "vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "sample_tokens"),
    ("attention.layer", "vllm.model_executor.layers.attention.attention", "Attention", "forward"),
    ("connector.pre_forward", "vllm.v1.worker.gpu.kv_connector", "ActiveKVConnector", "pre_forward"),
    ("connector.post_forward", "vllm.v1.worker.gpu.kv_connector", "ActiveKVConnector", "post_forward"),
    ("sekv.sched.get_num_new_matched_tokens", "vllm_sekv.scheduler_side.scheduler_connector", "SekvSchedulerSide",
     "get_num_new_matched_tokens"),
    ("sekv.sched.update_state_after_alloc", "vllm_sekv.scheduler_side.scheduler_connector", "SekvSchedulerSide",
     "update_state_after_alloc"),
    ("sekv.sched.build_connector_meta", "vllm_sekv.scheduler_side.scheduler_connector", "SekvSchedulerSide", "build_connector_meta"),
    ("sekv.sched.update_connector_output", "vllm_sekv.scheduler_side.scheduler_connector", "SekvSchedulerSide",
     "update_connector_output"),
    ("sekv.sched.request_finished", "vllm_sekv.scheduler_side.scheduler_connector", "SekvSchedulerSide", "request_finished"),
    ("sekv.scheduler.add_request", "vllm_sekv.scheduler_side.engine_scheduler", "SekvScheduler", "add_request"),
    ("sekv.worker.bind", "vllm_sekv.worker_side.worker_connector", "SekvWorkerSide", "bind"),
    ("sekv.worker.start_load_kv", "vllm_sekv.worker_side.worker_connector", "SekvWorkerSide", "start_load_kv"),
    ("sekv.restores.head_start_match", "vllm_sekv.worker_side.device_restores", "DeviceRestores", "head_start_match"),
    ("sekv.restores.head_start", "vllm_sekv.worker_side.device_restores", "DeviceRestores", "head_start"),
    ("sekv.restores.start", "vllm_sekv.worker_side.device_restores", "DeviceRestores", "start"),
    ("sekv.restores.writer", "vllm_sekv.worker_side.device_restores", "DeviceRestores", "_writer"),
    ("sekv.layerwise.init", "vllm_sekv.store.layerwise", "LayerwiseRestore", "__init__"),
    ("sekv.layerwise.start", "vllm_sekv.store.layerwise", "LayerwiseRestore", "start"),
    ("sekv.worker.capture_kv", "vllm_sekv.worker_side.worker_connector", "SekvWorkerSide", "capture_kv"),
    ("sekv.worker.observe_queries", "vllm_sekv.worker_side.worker_connector", "SekvWorkerSide", "observe_queries"),
    ("sekv.worker.build_worker_meta", "vllm_sekv.worker_side.worker_connector", "SekvWorkerSide", "build_worker_meta"),
    ("sekv.worker.flush_captures", "vllm_sekv.worker_side.worker_connector", "SekvWorkerSide", "_flush_captures"),
    ("sekv.worker.take_stats", "vllm_sekv.worker_side.worker_connector", "SekvWorkerSide", "take_stats"),
]

_SUMS: dict[str, list[float]] = {}  # label -> [calls, seconds]
_ENDS: dict[str, collections.deque] = {}  # label -> perf_counter() at the end of its last calls
_GC_STARTED = [0.0]
# `dump_every`: where this process appends its sums, how often, and when it last did.
_DUMP: dict = {"prefix": None, "every_s": 1.0, "last": 0.0}


def _gc_callback(phase: str, info: dict) -> None:
    """Python's garbage collector, timed like a method, per generation
    collected ("python.gc.gen0" ... "python.gc.gen2")."""
    if phase == "start":
        _GC_STARTED[0] = time.perf_counter()
    else:
        entry = _SUMS.setdefault(f"python.gc.gen{info.get('generation', '?')}", [0, 0.0])
        entry[0] += 1
        entry[1] += time.perf_counter() - _GC_STARTED[0]


def _timed(label: str, fn):
    entry = _SUMS.setdefault(label, [0, 0.0])
    ends = _ENDS.setdefault(label, collections.deque(maxlen=256))

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):

        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            t1 = time.perf_counter()
            entry[0] += 1
            entry[1] += t1 - t0
            ends.append(t1)
            if _DUMP["prefix"] is not None and t1 - _DUMP["last"] >= _DUMP["every_s"]:
                _dump(t1)

    return wrapper


def install(quiet: bool = False) -> list[str]:
    """Wrap every target found; returns the labels wrapped (and, unless
    `quiet`, prints why the others were not)."""
    done = []
    for label, module, cls_name, method in TARGETS:
        try:
            cls = getattr(importlib.import_module(module), cls_name)
        except (ImportError, AttributeError) as e:
            if not quiet:
                print(f"host timers: no {module}.{cls_name} ({type(e).__name__}: {e})", flush=True)
            continue
        fn = cls.__dict__.get(method)
        if fn is None or getattr(fn, "_host_timer", False):
            continue
        timed = _timed(label, fn)
        timed._host_timer = True
        setattr(cls, method, timed)
        done.append(label)
    if _gc_callback not in gc.callbacks:
        gc.callbacks.append(_gc_callback)
        done.append("python.gc")
    return done


def dump_every(prefix: str, every_s: float = 1.0) -> None:
    """From now on, at most every `every_s` seconds (checked when a timed
    call returns), append `{"t": perf_counter(), "sums": snapshot()}` as one
    line to `PREFIX.PID.jsonl`. A process forked after this call (vLLM's
    engine core, started by `AsyncLLM`) keeps its wrappers and writes its own
    file: how the host time of an engine in another process reaches its
    parent. `perf_counter` is the system's monotonic clock on Linux, so the
    lines of every process share one time axis (`read_dumps`, `sums_between`)."""
    _DUMP.update(prefix=prefix, every_s=every_s, last=0.0)


def _dump(now: float) -> None:
    _DUMP["last"] = now
    with open(f"{_DUMP['prefix']}.{os.getpid()}.jsonl", "a") as f:
        f.write(json.dumps({"t": now, "sums": snapshot()}) + "\n")


def read_dumps(prefix: str) -> dict[int, list[dict]]:
    """Every process's lines written under `prefix` (`dump_every`), by pid."""
    out = {}
    for path in glob.glob(f"{glob.escape(prefix)}.*.jsonl"):
        pid = int(path.rsplit(".", 2)[-2])
        out[pid] = [json.loads(line) for line in open(path) if line.strip()]
    return out


def sums_between(lines: list[dict], begin: float, end: float) -> tuple[dict, dict] | None:
    """One process's dumped sums around `begin` .. `end`, as `diff(before,
    after)` takes them: the last line at or before `begin` (none: zeros) and
    the first at or after `end` (none: the last line); None without lines."""
    if not lines:
        return None
    before = next((x["sums"] for x in reversed(lines) if x["t"] <= begin), {})
    after = next((x["sums"] for x in lines if x["t"] >= end), lines[-1]["sums"])
    return before, after


def snapshot() -> dict[str, tuple[int, float]]:
    return {label: (int(calls), seconds) for label, (calls, seconds) in _SUMS.items()}


def first_end_after(label: str, t0: float) -> float | None:
    """`perf_counter()` when `label`'s first call ending after `t0` returned
    (None if none did, among its last 256 calls)."""
    return next((t for t in _ENDS.get(label, ()) if t >= t0), None)


def diff(before: dict, after: dict, per: int = 1) -> dict[str, dict]:
    """What happened between two snapshots, per `per` steps: calls and ms."""
    out = {}
    for label, (calls, seconds) in after.items():
        c0, s0 = before.get(label, (0, 0.0))
        if calls > c0:
            out[label] = {"calls": (calls - c0) / per, "ms": (seconds - s0) * 1e3 / per}
    return out


def table(timings: dict[str, dict], title: str) -> str:
    lines = [f"{title}", "", "| method | calls | ms |", "|---|---|---|"]
    for label, t in sorted(timings.items(), key=lambda kv: -kv[1]["ms"]):
        lines.append(f"| {label} | {t['calls']:.1f} | {t['ms']:.3f} |")
    return "\n".join(lines)
