"""The fleet benchmark's engines (benchmarks/gpu/fleet_e2e.py) name valid
connector configurations, so that a run on the GPU machine never starts an
engine only to have it refuse its configuration."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def fleet(gpu_benchmark):
    return gpu_benchmark("fleet_e2e")


def test_every_sekv_engine_is_a_valid_configuration_with_its_codec_and_views(fleet):
    from vllm_sekv.config import SekvConfig

    for engine in fleet.ENGINES:
        transfer = fleet.kv_transfer_config(engine, 8 << 30, 4096)
        if engine == "plain":
            assert transfer is None
            continue
        if engine == "native":
            assert transfer["kv_connector"] == "OffloadingConnector"
            continue
        config = SekvConfig(**transfer["kv_connector_extra_config"])  # raises naming the key
        assert config.workspace_codec == fleet.codec_of(engine) == ("fp8" if "fp8" in engine else "exact")
        assert config.view_tokens == (4096 if engine.endswith("-views") else 0)


def test_the_summary_names_each_engine_by_how_it_serves_and_its_codec_apart(fleet):
    names = {(fleet.summary_engine(engine), fleet.codec_of(engine)) for engine in fleet.ENGINES}
    assert len(names) == len(fleet.ENGINES)
    assert fleet.summary_engine("sekv-fp8-views") == "sekv-views"
