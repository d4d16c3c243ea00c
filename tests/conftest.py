"""Shared fixtures. Engine tests use the real SmolLM2 model, prepared once."""
from __future__ import annotations

import os

import pytest

# vLLM on CPU: size its KV cache explicitly (GiB) for tests.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def model_dir() -> str:
    from vllm_sekv.models import prepare_model

    return str(prepare_model(quiet=True))


@pytest.fixture(scope="session")
def essay() -> str:
    from vllm_sekv.essays import essay_text

    return essay_text(max_chars=200_000)
