"""vLLM general-plugin entry point (`vllm.general_plugins: sekv`).

vLLM calls `register()` in every process it starts (API server, engine core,
workers), possibly more than once per process. It must be idempotent and cheap:
it records names and wraps a few of vLLM's functions (`compat.patches`); none
of sekv's own heavy modules is imported until vLLM asks for the connector
class or the attention backend.

What it switches on: the `sekv` KV connector (used when the user passes
`--kv-transfer-config '{"kv_connector":"sekv",...}'`), the attention hook
(a wrapper around the platform's attention backend that captures K/V and
shows queries to the connector; it does nothing unless the sekv connector is
active), with the same flag, the sekv scheduler (execution views), the
check of every request's sekv parameters (a bad one gets an HTTP 400), chat
prompts tokenized from the tokens of the recent prompt they extend, and a
KV cache sized for views (it must hold the model's window, not
`--max-model-len`: a session may be far longer than the cache).
"""
from __future__ import annotations

import threading

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
    compat.install_request_validation(CONNECTOR_NAME, _check_request)
    compat.install_prompt_token_reuse(CONNECTOR_NAME, _reuse_prompt_tokens)
    compat.size_kv_cache_for_views(CONNECTOR_NAME, compat.native_window_tokens)
    _registered = True


_limits: dict[int, tuple] = {}  # id(vllm_config) -> (config, window): parsed once per server


def _check_request(vllm_config, kv_transfer_params, extra_args, session_id) -> None:
    """The API side's check of a request's sekv parameters (an HTTP 400 on failure)."""
    from vllm_sekv import compat
    from vllm_sekv.config import SekvConfig
    from vllm_sekv.request_params import check

    key = id(vllm_config)
    if key not in _limits:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        _limits[key] = (SekvConfig.from_sources(extra), compat.native_window_tokens(vllm_config))
    check(*_limits[key], kv_transfer_params, extra_args, session_id)


class _PromptTokensReused:
    """`vllm:sekv_prompt_tokens_reused_total` on the API server's `/metrics`.
    A collector rather than a `prometheus_client.Counter`: vLLM's stat logger,
    made after the renderer, unregisters every `vllm:` Counter it finds."""

    HELP = "Prompt tokens an API server took from a recent prompt's tokens instead of tokenizing them"

    def __init__(self) -> None:
        self.total = 0
        self._lock = threading.Lock()

    def add(self, tokens: int) -> None:
        with self._lock:
            self.total += tokens

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        yield CounterMetricFamily("vllm:sekv_prompt_tokens_reused", self.HELP, value=self.total)


_reused_tokens: _PromptTokensReused | None = None


def _reuse_prompt_tokens(tokenizer) -> None:
    """The API side's prompt tokenizing through a `PromptTokenCache`."""
    global _reused_tokens
    from prometheus_client import REGISTRY

    from vllm_sekv.prompt_tokens import reuse_prompt_tokens

    if _reused_tokens is None:
        _reused_tokens = _PromptTokensReused()
        REGISTRY.register(_reused_tokens)
    reuse_prompt_tokens(tokenizer, on_reuse=_reused_tokens.add)
