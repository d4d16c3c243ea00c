"""The only things scheduler-side and worker-side connector code share:
the per-step plan (scheduler -> worker) and the step report (worker -> scheduler).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from vllm_sekv.workspace.plan import StepPlan


@dataclass
class SekvMetadata(KVConnectorMetadata):
    plan: StepPlan


@dataclass
class SekvWorkerMeta(KVConnectorWorkerMetadata):
    """What one worker reports after a step.

    With several ranks, `aggregate` keeps what holds for all of them: a step
    is confirmed when every rank finished it, a slot failed if any rank failed
    it, and a restore took as long as the slowest rank.
    """

    confirmed_step: int
    failed_slots: set[int] = field(default_factory=set)
    restore_seconds: dict[str, float] = field(default_factory=dict)

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "SekvWorkerMeta":
        assert isinstance(other, SekvWorkerMeta)
        seconds = dict(self.restore_seconds)
        for req_id, s in other.restore_seconds.items():
            seconds[req_id] = max(s, seconds.get(req_id, 0.0))
        return SekvWorkerMeta(
            confirmed_step=min(self.confirmed_step, other.confirmed_step),
            failed_slots=self.failed_slots | other.failed_slots,
            restore_seconds=seconds,
        )
