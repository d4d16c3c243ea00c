"""vLLM general-plugin entry point (`vllm.general_plugins: sekv`).

vLLM calls `register()` in every process it starts (API server, engine core,
workers), possibly more than once per process. It must be idempotent and cheap:
it only records names; nothing heavy is imported until vLLM asks for the
connector class or the attention backend.

What it switches on: the `sekv` KV connector (used when the user passes
`--kv-transfer-config '{"kv_connector":"sekv",...}'`), the attention hook
(a wrapper around the platform's attention backend that captures K/V and
shows queries to the connector; it does nothing unless the sekv connector is
active) and, with the same flag, the sekv scheduler (execution views).
"""
from __future__ import annotations

from vllm_sekv import CONNECTOR_NAME

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from vllm_sekv import compat

    compat.register_connector(CONNECTOR_NAME, "vllm_sekv.connector", "SekvConnector")
    compat.register_attention_hook()
    compat.install_scheduler_default(CONNECTOR_NAME)
    _registered = True
