"""The attention hook: the platform attention backend, wrapped.

The wrapper subclasses the platform's backend and impl classes and changes two
things: after the platform writes a step's K (post-RoPE) and V into the paged
cache, it hands the same tensors — `[tokens, kv_heads, head_dim]`, straight
from the attention layer's inputs — to the active sekv connector's
`capture_kv(layer, key, value, slot_mapping)`, for as long as the connector's
`capture_layers` asks for them (in a CUDA decode step only the first layer's:
the capture reads the paged cache after the forward, `compat.paged_kv_views`;
none where vLLM replays the step from a full CUDA graph, where no hook runs
and the worker sets the capture up before the forward);
and, in steps where the connector's `attention_hooks` is true, before
attention it shows the layer's queries to `observe_queries(layer, query)` (a
probe scores the block index with them), after making sure the layer's
restored KV is written (`wait_for_layer_load`, which vLLM normally calls just
before), and after attention it lets `merge_coarse(layer, query, output,
scale)` merge SeKV summaries into the output in place. Other steps (decode)
pay two attribute reads per layer.

`write_kv` is the restore path: the platform's own cache-update op, without
capture, so restored KV is not captured again.

Runs in the worker process, on the forward thread. With no sekv connector
active it only forwards to the platform class.
"""
from __future__ import annotations

from typing import Any

import torch

from vllm_sekv import compat


def wrap_impl(base: type) -> type:
    class SekvAttentionImpl(base):  # type: ignore[misc, valid-type]
        def do_kv_cache_update(
            self,
            layer: torch.nn.Module,
            key: torch.Tensor,
            value: torch.Tensor,
            kv_cache: torch.Tensor,
            slot_mapping: torch.Tensor,
        ) -> None:
            super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
            connector: Any = compat.active_connector()
            if getattr(connector, "capture_layers", False):
                connector.capture_kv(layer, key, value, slot_mapping)

        def forward(self, layer: torch.nn.Module, query: torch.Tensor, *args: Any, **kwargs: Any):
            connector: Any = compat.active_connector()
            if not getattr(connector, "attention_hooks", False):  # most steps: nothing to do here
                return super().forward(layer, query, *args, **kwargs)
            connector.wait_for_layer_load(layer.layer_name)  # idempotent; vLLM calls it first
            connector.observe_queries(layer, query)
            output = super().forward(layer, query, *args, **kwargs)
            connector.merge_coarse(layer, query, output, self.scale)
            return output

        def write_kv(
            self,
            layer: torch.nn.Module,
            key: torch.Tensor,
            value: torch.Tensor,
            kv_cache: torch.Tensor,
            slot_mapping: torch.Tensor,
        ) -> None:
            base.do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping)

    SekvAttentionImpl.__name__ = SekvAttentionImpl.__qualname__ = f"Sekv{base.__name__}"
    return SekvAttentionImpl


def wrap_backend(base: type) -> type:
    impl_cls = wrap_impl(base.get_impl_cls())

    class SekvAttentionBackend(base):  # type: ignore[misc, valid-type]
        @staticmethod
        def get_impl_cls() -> type:
            return impl_cls

    SekvAttentionBackend.__name__ = SekvAttentionBackend.__qualname__ = f"Sekv{base.__name__}"
    return SekvAttentionBackend


def __getattr__(name: str) -> type:
    """`Sekv<Base>` (e.g. `SekvCPUAttentionBackend`, `SekvFlashAttentionBackend`):
    the platform backend `<Base>` wrapped, built on first use (the path vLLM's
    backend registry was pointed at by `compat.register_attention_hook`)."""
    base = compat.attention_backend_base(name)
    if base is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    cls = globals()[name] = wrap_backend(base)
    return cls
