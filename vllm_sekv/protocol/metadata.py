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


FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")  # vLLM's e4m3 paged caches, whose bytes an fp8 workspace keeps as they are


def keeps_cache_bytes(config: SekvConfig, vllm_config: Any) -> bool:
    """Whether the workspace keeps the bytes of an fp8 paged cache as they
    are: `workspace_codec` fp8 under `--kv-cache-dtype fp8` (`store.fp8`)."""
    cache_dtype = str(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto"))
    return config.workspace_codec == "fp8" and cache_dtype in FP8_CACHE_DTYPES


def check_workspace_codec(config: SekvConfig, vllm_config: Any) -> None:
    """`workspace_codec` fp8 against the served model's paged cache: with an
    e4m3 cache it keeps the cache's bytes, which needs every layer's cache in
    fp8 and scales fixed at load time; any other quantized cache would be
    quantized twice. Refused naming the key."""
    if config.workspace_codec != "fp8":
        return
    cache_config = getattr(vllm_config, "cache_config", None)
    cache_dtype = str(getattr(cache_config, "cache_dtype", "auto"))
    if cache_dtype in FP8_CACHE_DTYPES:
        if getattr(cache_config, "kv_cache_dtype_skip_layers", None):
            raise ValueError("sekv config 'workspace_codec': fp8 keeps the fp8 paged cache's bytes, which needs "
                             "every layer's cache in fp8 (--kv-cache-dtype-skip-layers is set); use exact")
        if getattr(cache_config, "calculate_kv_scales", False):
            raise ValueError("sekv config 'workspace_codec': fp8 keeps the fp8 paged cache's bytes, whose scales "
                             "must be fixed at load time (--calculate-kv-scales is set); use exact")
    elif cache_dtype not in ("auto", "float16", "bfloat16", "float32"):
        raise ValueError(f"sekv config 'workspace_codec': fp8 with a {cache_dtype} paged cache (--kv-cache-dtype) "
                         f"would quantize K/V twice; use workspace_codec exact")


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
