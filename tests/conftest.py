"""Shared fixtures. Engine tests use the real SmolLM2 model, prepared once."""
from __future__ import annotations

import os

import pytest

# vLLM on CPU: size its KV cache explicitly (GiB) for tests.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# An engine's worker runs inside its engine-core process, as on one GPU (vLLM's
# CPU build would start a worker process: one more import of vLLM per server).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

# Under pytest-xdist (`scripts/run_tests.sh` runs two files at a time) every
# engine this worker starts computes on one OpenMP thread, unbound: vLLM would
# otherwise bind each engine's threads to all the cores, and two engines'
# spinning threads would take turns on the same ones.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


@pytest.fixture(scope="session")
def model_dir() -> str:
    from vllm_sekv.models import prepare_model

    return str(prepare_model(quiet=True))


@pytest.fixture(scope="session")
def essay() -> str:
    from vllm_sekv.calibration_corpus import essay_text

    return essay_text(max_chars=200_000)


@pytest.fixture(scope="session")
def eval_tasks():
    """benchmarks/eval/tasks.py (the evaluation's task generators) as a module."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "eval" / "tasks.py"
    spec = importlib.util.spec_from_file_location("eval_tasks", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["eval_tasks"] = module
    spec.loader.exec_module(module)
    return module
