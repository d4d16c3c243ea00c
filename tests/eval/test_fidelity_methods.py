"""The fidelity harness's methods (benchmarks/fidelity/run.py) name valid
server configurations and request parameters, so that a run on the GPU
machine never starts a server only to have it refuse its configuration."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

FIDELITY = Path(__file__).resolve().parents[2] / "benchmarks" / "fidelity"


@pytest.fixture(scope="module")
def run():
    """benchmarks/fidelity/run.py under a name of its own (benchmarks/faults has a run.py too)."""
    spec = importlib.util.spec_from_file_location("fidelity_run", FIDELITY / "run.py")
    module = importlib.util.module_from_spec(spec)
    sys.path[:0] = [str(FIDELITY), str(FIDELITY.parent)]  # its sibling modules
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.path[:2]
    return module


def test_every_server_configuration_is_valid(run):
    from vllm_sekv.config import SekvConfig

    for name, extra in run.SEKV_CONFIGS.items():
        SekvConfig.from_sources(extra, environ={})  # raises naming the key


def test_every_request_method_runs_on_a_known_server_with_valid_parameters(run):
    from vllm_sekv.config import SekvConfig
    from vllm_sekv import request_params

    for name, (server, params) in run.REQUEST_METHODS.items():
        assert server in run.SEKV_CONFIGS, name
        config = SekvConfig.from_sources(run.SEKV_CONFIGS[server], environ={})  # as its server builds it
        request_params.check(config, 32768, params, None, None)  # raises naming the field


def test_the_accurate_preset_is_the_configuration_the_evaluation_measured(run):
    """`view_preset` accurate serves what the evaluation's best view served
    through its server's keys and each request's parameters."""
    from vllm_sekv.config import SekvConfig

    server, params = run.REQUEST_METHODS["views-rerank-rh-lexhop-hop3-sel32-psg8-lines-drop-rcall-ord"]
    keys = {k: ("on" if v is True else v) for k, v in params.items()}
    measured = SekvConfig.from_sources({**run.SEKV_CONFIGS[server], **keys}, environ={})
    preset = SekvConfig.from_sources(run.SEKV_CONFIGS["views-accurate"], environ={})
    assert preset == SekvConfig.from_sources({**measured.to_extra_config(), "view_preset": "accurate"}, environ={})
