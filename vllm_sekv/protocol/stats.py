"""Connector figures for vLLM's periodic log line and Prometheus endpoint.

Workers fill a `SekvStats` per step (`get_kv_connector_stats`); vLLM sums them
across ranks and steps (`aggregate`), logs `reduce()` and feeds `observe` of
`SekvPromMetrics`, which exports counters named `vllm:sekv_*`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

_COUNTERS = {
    "restored_tokens": "Tokens restored from the sekv workspace instead of prefilled",
    "captured_tokens": "Tokens whose K/V the sekv workspace captured",
    "restores": "Restore operations (one per request and step)",
    "views": "Steps served from an execution view (selected history, re-RoPE'd)",
    "probes": "Probe passes that scored the views' block index",
    "surprisal_tokens": "Captured tokens whose surprisal the model's own logits recorded (SeKV)",
    "restored_bytes": "Bytes moved host->device by restores (lowrank factors where restore_codec is lossy)",
    "resident_blocks": "Restored blocks copied from the device's resident pool instead of the host (resident_bytes)",
    "summaries": "SeKV coarse summaries built for views (one pseudo-token each)",
    "summary_bytes": "Bytes of SeKV coarse summaries placed on the device (K and V, all layers)",
    "coarse_rows": "Attention rows (token x layer) with SeKV summaries merged in",
    "capture_failures": "Captured blocks dropped because a row was missing",
    "nvme_written_blocks": "Blocks written to the NVMe tier",
    "nvme_read_blocks": "Blocks read back from the NVMe tier (checksum verified)",
    "nvme_failures": "NVMe reads or writes that failed (each a miss, recomputed)",
    "remote_written_blocks": "Blocks written to the remote tier",
    "remote_read_blocks": "Blocks read from the remote tier (identity and checksum verified)",
    "remote_failures": "Remote reads, writes or lookups that failed (each a miss, recomputed)",
}
_SECONDS = "restore_seconds"


@dataclass
class SekvStats(KVConnectorStats):
    def __post_init__(self) -> None:
        for key in (*_COUNTERS, _SECONDS):
            self.data.setdefault(key, 0)

    def add(self, key: str, amount: float) -> None:
        self.data[key] += amount

    def reset(self) -> None:
        for key in self.data:
            self.data[key] = 0

    def aggregate(self, other: KVConnectorStats) -> "SekvStats":
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: int(self.data[k]) for k in _COUNTERS}
        out["restore_ms"] = round(1000.0 * self.data[_SECONDS], 2)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class SekvPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {}
        for key, doc in {**_COUNTERS, _SECONDS: "Seconds spent restoring KV"}.items():
            counter = self._counter_cls(
                name=f"vllm:sekv_{key}",  # exported with a `_total` suffix
                documentation=doc,
                labelnames=labelnames,
            )
            self._counters[key] = {
                idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self._counters.items():
            amount = transfer_stats_data.get(key, 0)
            if amount:
                per_engine[engine_idx].inc(amount)
