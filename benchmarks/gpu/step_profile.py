"""What the device does in an engine's steps: a PyTorch profiler trace of a
stretch of engine steps, summed by kernel and copy.

The host timers (`host_timers.py`) say where an engine step's host time
goes; when the host waits for the device they cannot say for what. This
module profiles the device: `install(prefix, first_step, steps)` wraps the
engine core's step methods in the running vLLM; the call that makes
`first_step` steps starts `torch.profiler` (CPU and CUDA activities), the one
that makes `first_step + steps` stops it and writes `PREFIX.PID.json`:

    {"steps": N, "device_ms": total, "ops": [{"name", "device_ms", "calls"}, ...]}

`ops` are the profiler's device events summed by name (kernels, memcpy and memset),
the largest device time first (`device_ms` per op is its self device time
over the N steps; without CUDA, host ops by their own CPU time). Meant to run in an engine core started by a benchmark
(`fleet_e2e.py --profile-steps`, through the same `sitecustomize` as its
timers); the profiler slows the host, so the stretch is for attributing
device time, not for timing steps.
"""
from __future__ import annotations

import functools
import importlib
import json
import os

TARGETS = [("vllm.v1.engine.core", "EngineCore", "step"),
           ("vllm.v1.engine.core", "EngineCore", "step_with_batch_queue")]

_STATE: dict = {"calls": 0, "profiler": None}


def install(prefix: str, first_step: int, steps: int) -> list[str]:
    """Wrap the engine core's step methods found; returns those wrapped."""
    done = []
    for module, cls_name, method in TARGETS:
        try:
            cls = getattr(importlib.import_module(module), cls_name)
        except (ImportError, AttributeError):
            continue
        fn = cls.__dict__.get(method)
        if fn is None or getattr(fn, "_step_profile", False):
            continue
        wrapped = _wrap(fn, prefix, first_step, steps)
        wrapped._step_profile = True
        setattr(cls, method, wrapped)
        done.append(f"{cls_name}.{method}")
    return done


def _wrap(fn, prefix: str, first_step: int, steps: int):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _STATE["calls"] += 1
        calls = _STATE["calls"]
        if calls == first_step:
            _start()
        try:
            return fn(*args, **kwargs)
        finally:
            if calls == first_step + steps - 1 and _STATE["profiler"] is not None:
                _stop(prefix, steps)

    return wrapper


def _start() -> None:
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    _STATE["profiler"] = torch.profiler.profile(activities=activities)
    _STATE["profiler"].__enter__()


def _stop(prefix: str, steps: int) -> None:
    import torch

    prof, _STATE["profiler"] = _STATE["profiler"], None
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prof.__exit__(None, None, None)
    cuda = torch.cuda.is_available()
    ops = []
    for e in prof.key_averages():
        on_device = "CUDA" in str(getattr(e, "device_type", "CUDA"))
        if on_device != cuda:  # on CUDA host ops are left out (their kernels count on their own)
            continue
        if cuda:
            device_us = getattr(e, "self_device_time_total", None)
            if device_us is None:
                device_us = getattr(e, "self_cuda_time_total", 0)
        else:  # the device is the CPU: host ops by their own time
            device_us = e.self_cpu_time_total
        if device_us > 0:
            ops.append({"name": e.key, "device_ms": round(device_us / 1e3, 3), "calls": e.count})
    ops.sort(key=lambda o: -o["device_ms"])
    out = {"steps": steps, "device_ms": round(sum(o["device_ms"] for o in ops), 3), "ops": ops[:60]}
    with open(f"{prefix}.{os.getpid()}.json", "w") as f:
        json.dump(out, f, indent=1)


def read(prefix: str) -> dict | None:
    """The profile written under `prefix` by any process (the engine core's), or None."""
    import glob

    for path in sorted(glob.glob(f"{glob.escape(prefix)}.*.json")):
        return json.loads(open(path).read())
    return None
