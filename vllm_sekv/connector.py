"""The `sekv` KV connector: a thin facade that dispatches on vLLM's role.

One instance lives in the scheduler process (its `scheduler_side`) and one
in each worker (its `worker_side`); the two sides share only
`vllm_sekv.protocol`. vLLM's calls arrive here and go to the side that
serves them.
"""
from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)

from vllm_sekv import compat
from vllm_sekv.config import SekvConfig
from vllm_sekv.protocol.metadata import SekvMetadata
from vllm_sekv.protocol.stats import SekvPromMetrics, SekvStats


class SekvConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.config = SekvConfig.from_sources(extra)
        if compat.kv_update_replayed_from_cuda_graphs(vllm_config):
            raise ValueError(
                "sekv: vLLM would replay the attention layers' KV-cache update from CUDA graphs "
                "(compilation_config.splitting_ops without vllm::unified_kv_cache_update, or "
                "compilation_config.use_inductor_graph_partition), where sekv cannot capture new KV; "
                "keep vLLM's default splitting_ops or run with --enforce-eager")
        self._scheduler = self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            from vllm_sekv.scheduler_side.scheduler_connector import SekvSchedulerSide

            self._scheduler = SekvSchedulerSide(self.config, vllm_config, kv_cache_config)
        else:
            from vllm_sekv.worker_side.worker_connector import SekvWorkerSide

            self._worker = SekvWorkerSide(self.config, vllm_config)

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict) -> None:
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, SekvMetadata)
        self._worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker.start_load_kv(forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layerwise restores (CUDA) write each layer here; also called by the
        attention hook, so a layer is written even where vLLM skips this call."""
        if self._worker is not None:
            self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # K/V are captured by the attention hook (capture_kv), not from paged bytes

    def wait_for_save(self) -> None:
        return  # captures are stored after the forward (`build_connector_worker_meta`)

    def capture_kv(self, layer: Any, key: Any, value: Any, slot_mapping: Any) -> None:
        """Called by the attention hook after the platform wrote a layer's K/V."""
        if self._worker is not None:
            self._worker.capture_kv(layer, key, value, slot_mapping)

    @property
    def capture_layers(self) -> bool:
        """Whether the attention hook must call `capture_kv` for the next layer."""
        return self._worker is not None and self._worker.capture_layers

    @property
    def attention_hooks(self) -> bool:
        """Whether this step needs `observe_queries` / `merge_coarse` (and the
        hook's `wait_for_layer_load`) around each layer's attention."""
        return self._worker is not None and self._worker.attention_hooks

    def observe_queries(self, layer: Any, query: Any) -> None:
        """Called by the attention hook with a layer's queries, before attention."""
        if self._worker is not None:
            self._worker.observe_queries(layer, query)

    def merge_coarse(self, layer: Any, query: Any, output: Any, scale: float) -> None:
        """Called by the attention hook after attention: SeKV summaries merged in place."""
        if self._worker is not None:
            self._worker.merge_coarse(layer, query, output, scale)

    def build_connector_worker_meta(self) -> Any:
        return self._worker.build_worker_meta()

    def get_kv_connector_stats(self) -> Any:
        return self._worker.take_stats() if self._worker is not None else None

    # --------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> SekvMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        return self._scheduler.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        """Keep vLLM stepping (with empty steps if need be) while blocks wait
        to be written behind to the NVMe or remote tier: after a session's
        last request its blocks still reach the tiers, where another server
        or a restart finds them."""
        return self._scheduler is not None and self._scheduler.planner.has_pending_writes()

    @property
    def views(self) -> Any:
        """The execution views' coordinator (scheduler side; None in workers)."""
        return self._scheduler.views if self._scheduler is not None else None

    def view_pass_done(self, request: Any) -> None:
        self._scheduler.view_pass_done(request)

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict) -> bool:
        """Whether vLLM must keep to piecewise CUDA graphs (attention, and the
        attention hook, outside them). Decode batches may replay full graphs:
        the worker does such a step's capture around the graph, and finishes
        its restores before it (`SekvWorkerSide._begin_unhooked_forward`).
        SeKV coarse attention and surprisal act inside every layer of every
        step: with either on, piecewise."""
        config = SekvConfig.from_sources(extra_config)
        return config.coarse == "on" or config.surprisal == "on"

    # ------------------------------------------------------------ metrics

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None) -> SekvStats:
        return SekvStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return SekvPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
