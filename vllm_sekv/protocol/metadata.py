"""The only things scheduler-side and worker-side connector code share:
the per-step plan (scheduler -> worker), the step report (worker ->
scheduler), and how both size the tiers and name the NVMe folder from the
config and the model.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from vllm_sekv import model_identity
from vllm_sekv.config import SekvConfig
from vllm_sekv.store import HostPool
from vllm_sekv.store.nvme import NvmeLayout, folder_name
from vllm_sekv.store.records import RecordLayout, codec_code, fingerprint_digest
from vllm_sekv.workspace.step_plan import StepPlan


@dataclass
class SekvMetadata(KVConnectorMetadata):
    plan: StepPlan


@dataclass
class SekvWorkerMeta(KVConnectorWorkerMetadata):
    """What one worker reports after a step.

    With several ranks, `aggregate` keeps what holds for all of them: a step
    is confirmed when every rank finished it, a slot failed if any rank failed
    it, a restore took as long as the slowest rank, NVMe completions of all
    ranks are passed on for the scheduler side to count, each rank's probe
    scores (its own heads) are stacked, surprisal comes from the rank
    that computed it, and a request's blocks placed from the resident pool
    are counted once (every rank places the same).
    """

    confirmed_step: int
    failed_slots: set[int] = field(default_factory=set)
    restore_seconds: dict[str, float] = field(default_factory=dict)
    # NVMe and remote operations finished since the last report: (kind, block hash, ok);
    # one entry per rank, the scheduler side waits for all ranks.
    io_completions: list[tuple[str, bytes, bool]] = field(default_factory=list)
    # Finished probes: req_id -> [rows, candidates] float32, one row per
    # (layer, query head) this rank holds (`sum over queries of softmax over
    # candidates`); ranks' rows are stacked.
    scores: dict[str, np.ndarray] = field(default_factory=dict)
    # SeKV: surprisal of the tokens captured this step, (host rows int64,
    # values float32, NaN where unknown). Only the rank that holds the logits
    # computes it; the first non-empty report is kept.
    surprisal: tuple[np.ndarray, np.ndarray] | None = None
    # Facts the device still has to tell (`device_reports`: restore timings,
    # paged capture checks), folded into `restore_seconds` and `failed_slots`
    # by `settled()`. Read those two only from `settled()`.
    pending: list[Any] = field(default_factory=list)
    # Blocks of this step's restores copied from the device's resident pool
    # instead of moved from the host (`resident_bytes`): req_id -> blocks.
    resident_blocks: dict[str, int] = field(default_factory=dict)

    def settled(self) -> "SekvWorkerMeta":
        """This report with every pending device fact read in. It waits only
        for device work still running, which by the time vLLM hands the report
        over is at most a capture's check (`device_reports`)."""
        for fact in self.pending:
            fact.apply(self.restore_seconds, self.failed_slots)
        self.pending = []
        return self

    def __getstate__(self) -> dict:
        """Sent to another process settled: CUDA events do not travel."""
        return dict(self.settled().__dict__)

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "SekvWorkerMeta":
        assert isinstance(other, SekvWorkerMeta)
        self.settled(), other.settled()
        seconds = dict(self.restore_seconds)
        for req_id, s in other.restore_seconds.items():
            seconds[req_id] = max(s, seconds.get(req_id, 0.0))
        return SekvWorkerMeta(
            confirmed_step=min(self.confirmed_step, other.confirmed_step),
            failed_slots=self.failed_slots | other.failed_slots,
            restore_seconds=seconds,
            io_completions=self.io_completions + other.io_completions,
            scores={
                req_id: np.concatenate([m.scores[req_id] for m in (self, other) if req_id in m.scores])
                for req_id in self.scores.keys() | other.scores.keys()
            },
            surprisal=self.surprisal if self.surprisal is not None else other.surprisal,
            resident_blocks={req_id: max(m.resident_blocks.get(req_id, 0) for m in (self, other))
                             for req_id in self.resident_blocks.keys() | other.resident_blocks.keys()},
        )


def check_workspace_codec(config: SekvConfig, vllm_config: Any) -> None:
    """`workspace_codec` fp8 against the served model: a paged cache that is
    already fp8 (`--kv-cache-dtype fp8*`) would quantize twice (host fp8,
    then the cache's own): refused, naming the key."""
    cache_dtype = str(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto"))
    if config.workspace_codec == "fp8" and cache_dtype.startswith("fp8"):
        raise ValueError(f"sekv config 'workspace_codec': fp8 with an fp8 paged cache (--kv-cache-dtype "
                         f"{cache_dtype}) would quantize K/V twice; use workspace_codec exact")


def block_bytes_per_rank(config: SekvConfig, vllm_config: Any) -> int:
    """Host bytes of one block on one rank, under the configured `workspace_codec`."""
    check_workspace_codec(config, vllm_config)
    geo = model_identity.kv_geometry(vllm_config)
    return HostPool.bytes_per_block(
        geo.num_layers, config.block_tokens, geo.kv_heads, geo.head_dim, geo.dtype, config.workspace_codec
    )


def host_slots(config: SekvConfig, vllm_config: Any) -> tuple[int, int]:
    """(number of host slots, bytes per block over all ranks) under `host_bytes`."""
    block_bytes = block_bytes_per_rank(config, vllm_config) * model_identity.kv_geometry(vllm_config).world_size
    num_slots = config.host_bytes // block_bytes
    if num_slots < 1:
        raise ValueError(
            f"sekv config 'host_bytes': {config.host_bytes} bytes cannot hold one block "
            f"of {config.block_tokens} tokens ({block_bytes} bytes for this model)"
        )
    return num_slots, block_bytes


def nvme_layout(config: SekvConfig, vllm_config: Any) -> NvmeLayout:
    fingerprint = model_identity.model_fingerprint(vllm_config, config.block_tokens, config.workspace_codec)
    return NvmeLayout(config.nvme_dir, folder_name(fingerprint))


def record_layout(config: SekvConfig, vllm_config: Any, rank: int) -> RecordLayout:
    """What every NVMe record of this model and `rank` must say about itself."""
    geo = model_identity.kv_geometry(vllm_config)
    fingerprint = model_identity.model_fingerprint(vllm_config, config.block_tokens, config.workspace_codec)
    return RecordLayout(fingerprint_digest(fingerprint), config.block_tokens, geo.num_layers, geo.kv_heads,
                        geo.head_dim, geo.dtype, rank, block_bytes_per_rank(config, vllm_config),
                        codec_code(config.workspace_codec))
