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
