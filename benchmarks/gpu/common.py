"""Shared helpers for the GPU component benchmarks: timing, machine facts,
Llama-3-8B KV geometry. Timings are medians of repeated runs after a warm-up."""
from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KvGeometry:
    """KV geometry of the benchmarked model (Llama-3-8B by default), bf16."""

    num_layers: int = 32
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_tokens: int = 32
    page_size: int = 16
    dtype: torch.dtype = torch.bfloat16

    @property
    def token_bytes(self) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * self.token_bytes

    def as_dict(self) -> dict:
        return {"num_layers": self.num_layers, "q_heads": self.q_heads, "kv_heads": self.kv_heads,
                "head_dim": self.head_dim, "block_tokens": self.block_tokens, "page_size": self.page_size,
                "dtype": str(self.dtype).replace("torch.", "")}


LLAMA3_8B = KvGeometry()


def wall_ms(fn, repeats: int = 5, warmup: int = 1) -> list[float]:
    """Host wall time (ms) of `fn` with device syncs around it; one entry per repeat."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def event_ms(fn, repeats: int = 5, warmup: int = 1) -> list[float]:
    """Device time (ms) of `fn` between CUDA events on the current stream."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def machine_facts() -> dict:
    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": props.name, "sm_count": props.multi_processor_count,
        "gpu_memory_bytes": props.total_memory, "torch": torch.__version__,
        "cuda": torch.version.cuda, "python": platform.python_version(),
        "triton": __import__("triton").__version__,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_json(path: str, payload: dict) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=False)
