"""sekv's attention hook is Python: a step whose KV-cache update vLLM replays
from a CUDA graph would never reach it. vLLM's defaults keep that op out of
the graphs; a configuration that does not fails at start-up, naming the key."""
from types import SimpleNamespace

import pytest
from vllm.config import CompilationConfig, CUDAGraphMode

from vllm_sekv import compat

KV_UPDATE = "vllm::unified_kv_cache_update"


def _vllm_config(**compilation):
    return SimpleNamespace(compilation_config=CompilationConfig(**compilation))


@pytest.mark.parametrize("compilation, replayed", [
    ({"cudagraph_mode": CUDAGraphMode.NONE}, False),  # eager
    ({"cudagraph_mode": CUDAGraphMode.PIECEWISE, "cudagraph_capture_sizes": []}, False),  # no graph captured
    # vLLM's default on GPUs: splitting ops not given, the update is kept out of the graphs
    ({"cudagraph_mode": CUDAGraphMode.PIECEWISE, "cudagraph_capture_sizes": [1, 2, 4]}, False),
    ({"cudagraph_mode": CUDAGraphMode.PIECEWISE, "cudagraph_capture_sizes": [1, 2, 4],
      "splitting_ops": ["vllm::unified_attention_with_output", KV_UPDATE, "vllm::unified_mla_kv_cache_update"]},
     False),
    # custom splitting ops that leave the update inside the graphs
    ({"cudagraph_mode": CUDAGraphMode.PIECEWISE, "cudagraph_capture_sizes": [1, 2, 4],
      "splitting_ops": ["vllm::unified_attention_with_output"]}, True),
])
def test_kv_update_replayed_from_cuda_graphs(compilation, replayed):
    assert compat.kv_update_replayed_from_cuda_graphs(_vllm_config(**compilation)) is replayed


def test_the_connector_refuses_such_a_configuration_at_start_up():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from vllm_sekv.connector import SekvConnector

    config = _vllm_config(cudagraph_mode=CUDAGraphMode.PIECEWISE, cudagraph_capture_sizes=[1, 2],
                          splitting_ops=["vllm::unified_attention_with_output"])
    config.kv_transfer_config = SimpleNamespace(kv_connector_extra_config={})
    with pytest.raises(ValueError, match="would replay the attention layers. KV-cache update"):
        SekvConnector(config, KVConnectorRole.SCHEDULER)


def test_vllm_on_this_cpu_captures_no_graphs(model_dir):
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(model=model_dir,  # not eager: vLLM's defaults
                        kv_transfer_config={"kv_connector": "sekv", "kv_role": "kv_both"}).create_engine_config()
    assert not compat.kv_update_replayed_from_cuda_graphs(config)
