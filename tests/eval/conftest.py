"""Fixtures of the benchmark harness tests."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

GPU_BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"


@pytest.fixture(scope="session")
def gpu_benchmark():
    """`gpu_benchmark(name)`: the module `name` of benchmarks/gpu, imported
    with its sibling modules (and benchmarks/) on the path."""
    def load(name: str):
        sys.path[:0] = [str(GPU_BENCHMARKS), str(GPU_BENCHMARKS.parent)]
        try:
            return importlib.import_module(name)
        finally:
            del sys.path[:2]
    return load
