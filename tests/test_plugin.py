"""The entry point vLLM runs in every process, possibly twice."""
from vllm_sekv import plugin


def test_register_is_idempotent_and_switches_everything_on(monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    for _ in range(2):
        monkeypatch.setattr(plugin, "_registered", False)  # as in a fresh process
        plugin.register()
        plugin.register()
    from vllm_sekv.connector import SekvConnector

    assert KVConnectorFactory.get_connector_class_by_name("sekv") is SekvConnector
    assert AttentionBackendEnum.CPU_ATTN.get_path() == "vllm_sekv.attention.backend.SekvCPUAttentionBackend"


def test_the_hook_wraps_the_platform_backend_without_copying_it():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

    from vllm_sekv.attention.backend import SekvCPUAttentionBackend

    assert issubclass(SekvCPUAttentionBackend, CPUAttentionBackend)
    impl = SekvCPUAttentionBackend.get_impl_cls()
    assert issubclass(impl, CPUAttentionBackendImpl)
    # Only the KV-cache update and the entry of forward are wrapped; the
    # attention computation itself is the platform's.
    own = {name for name, value in vars(impl).items() if callable(value) and not name.startswith("_")}
    assert own == {"do_kv_cache_update", "forward", "write_kv"}


def _engine_config(model_dir, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    plugin.register()
    return EngineArgs(model=model_dir, max_model_len=2048, **kwargs).create_engine_config()


SEKV_FLAG = {"kv_connector": "sekv", "kv_role": "kv_both"}


def test_the_connector_flag_alone_selects_the_sekv_scheduler(model_dir):
    from vllm_sekv.compat.patches import SCHEDULER_CLS

    config = _engine_config(model_dir, kv_transfer_config=SEKV_FLAG)
    assert not config.scheduler_config.async_scheduling  # the CPU build schedules synchronously
    assert config.scheduler_config.scheduler_cls == SCHEDULER_CLS
    plain = _engine_config(model_dir)
    assert plain.scheduler_config.scheduler_cls != SCHEDULER_CLS


def test_asynchronous_scheduling_gets_the_async_sekv_scheduler():
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_sekv.compat.patches import ASYNC_SCHEDULER_CLS, SCHEDULER_CLS, sekv_scheduler_cls
    from vllm_sekv.scheduler_side.engine_scheduler import SekvAsyncScheduler, SekvScheduler

    assert sekv_scheduler_cls(True) == ASYNC_SCHEDULER_CLS and sekv_scheduler_cls(False) == SCHEDULER_CLS
    assert issubclass(SekvAsyncScheduler, AsyncScheduler) and not issubclass(SekvScheduler, AsyncScheduler)
    mro = SekvAsyncScheduler.__mro__
    # the sekv hooks come before both vLLM schedulers', AsyncScheduler's before Scheduler's
    assert mro.index(SekvScheduler) < mro.index(AsyncScheduler) < mro.index(Scheduler)
    for hook in ("add_request", "update_from_output", "_sekv_cap"):
        assert getattr(SekvAsyncScheduler, hook) is getattr(SekvScheduler, hook)


def test_an_explicit_scheduler_is_left_alone(model_dir):
    other = "vllm.v1.core.sched.scheduler.Scheduler"
    config = _engine_config(model_dir, kv_transfer_config=SEKV_FLAG, scheduler_cls=other)
    assert config.scheduler_config.scheduler_cls == other


def test_the_scheduler_caps_a_pass_through_vllms_own_prefill_hook():
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_sekv.scheduler_side.engine_scheduler import SekvScheduler

    # vLLM 0.32 calls `_reserve_prefill_lookahead` for every prefill chunk; the
    # sekv scheduler reaches its view cap through it.
    assert hasattr(Scheduler, "_reserve_prefill_lookahead")
    assert "_reserve_prefill_lookahead" in vars(SekvScheduler.__mro__[1])


def test_a_sekv_servers_kv_cache_must_hold_the_window_not_max_model_len(model_dir):
    """vLLM checks that its KV cache holds one request of `max_model_len`
    tokens; a sekv server's requests hold at most the model's window (8192 for
    SmolLM2), so its `max_model_len` may exceed the cache (a long session)."""
    import pytest
    import torch
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.engine import core
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_sekv import compat

    plugin.register()
    assert core.get_kv_cache_configs is kv_cache_utils.get_kv_cache_configs  # the engine core's name too

    def configs(**kwargs):
        config = _engine_config(model_dir, **kwargs)
        config.model_config.max_model_len = 65536
        config.cache_config.kv_cache_layout = "LBHNC"  # the engine core resolves it before sizing the cache
        spec = FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=64, dtype=torch.float32)
        specs = {f"model.layers.{i}.self_attn.attn": spec for i in range(30)}
        memory = 12000 * spec.page_size_bytes * 30 // 16  # 12000 tokens: above the window, below 65536
        return config, core.get_kv_cache_configs(config, [specs], [memory])

    config, (sized,) = configs(kv_transfer_config=SEKV_FLAG)
    assert compat.native_window_tokens(config) == 8192 and config.model_config.max_model_len == 65536
    assert 8192 <= sized.num_blocks * 16 < 65536
    with pytest.raises(ValueError, match="max seq len"):  # a plain server is refused, as vLLM refuses it
        configs()
