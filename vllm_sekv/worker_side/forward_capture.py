"""One forward's capture: the planned rows' new K/V, from every layer, into
their host rows, keys rotated to their virtual positions.

Two ways to read them, chosen per step:
* paged (CUDA, the cache layouts `compat.paged_kv_views` knows): after the
  forward, one launch gathers the planned paged slots from every layer's
  cache; whether the batch wrote each slot is checked on the device
  (`CaptureCheck`, in the step's report). The views are trusted once a
  capture read through them matched the attention layer's own K/V;
* layer by layer (CPU, or views not trusted): the attention hook hands each
  layer's K/V, the planned batch rows are kept on the device (`StepCapture`).

A planned row that cannot be captured fails its host slot: the block is never
committed (a miss, recomputed), never stale KV. Under `workspace_codec` fp8
so does a slot whose K/V is not finite (`HostPool.take_failed_slots`; on CUDA
a `SlotCheck` the step's report reads from the device). Runs on the forward thread.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from vllm_sekv import compat
from vllm_sekv.protocol.stats import SekvStats
from vllm_sekv.model_identity import KVGeometry
from vllm_sekv.ops import RopeSpec
from vllm_sekv.store import HostPool
from vllm_sekv.store.capture import CaptureWriter, StepCapture
from vllm_sekv.store.host_pool import to_device
from vllm_sekv.worker_side.device_reports import CaptureCheck, SlotCheck
from vllm_sekv.workspace.step_plan import StepPlan

logger = logging.getLogger("vllm_sekv")
NON_FINITE = "non-finite K/V cannot be stored as fp8"


def paged_cache_views(kv_caches: dict[str, torch.Tensor], layer_of: dict[str, int], geometry: KVGeometry,
                      dtype: torch.dtype) -> tuple[list, list] | None:
    """Every layer's (K, V) paged-cache views, if all layers have them with
    one stride set each (what `ops.gather_rerope` reads) and the pool's
    dtype; else None (captured layer by layer)."""
    first: dict[int, torch.Tensor] = {}
    for name, kv_cache in kv_caches.items():
        first.setdefault(layer_of[name], kv_cache)
    if any(t.device.type != "cuda" for t in first.values()):
        return None
    views = [compat.paged_kv_views(first[i], geometry.kv_heads, geometry.head_dim)
             for i in range(geometry.num_layers)]
    if any(v is None for v in views):
        return None
    keys, values = [k for k, _ in views], [v for _, v in views]
    if keys[0].dtype != dtype:
        return None
    for group in (keys, values):
        if any(t.stride() != group[0].stride() or t.shape != group[0].shape for t in group):
            return None
    return keys, values


class ForwardCapture:
    def __init__(self, pool: HostPool, writer: CaptureWriter, geometry: KVGeometry, rope: RopeSpec,
                 block_tokens: int, stats: SekvStats, cache_views: tuple[list, list] | None) -> None:
        self.pool = pool
        self.writer = writer
        self.geometry = geometry
        self.rope = rope
        self.block_tokens = block_tokens
        self.stats = stats
        self.current: StepCapture | None = None  # this step's, kept on the device until the forward ends
        self.cache_views = cache_views
        self.views_checked = False
        # Until the views are trusted a paged capture also keeps its first
        # layer's rows from the hook (batch rows, on the device).
        self._check_rows: torch.Tensor | None = None
        self.failed_slots: set[int] = set()

    @property
    def reads_paged(self) -> bool:
        """Whether a capture can read the paged caches after the forward without a check."""
        return self.views_checked and self.cache_views is not None

    @property
    def layer_by_layer(self) -> bool:
        return self.current is not None and not self.current.paged

    def reset(self) -> None:
        self.current = self._check_rows = None

    def begin_paged(self, plan: StepPlan, slot_mapping: torch.Tensor) -> CaptureCheck:
        """Capture every planned row from the paged caches after the forward;
        returns the device-side check that the batch wrote each planned slot
        (a slot it did not write fails its host slot there)."""
        slots = to_device(plan.capture_paged_slots, slot_mapping.device)
        check = CaptureCheck(slots, slot_mapping, plan.capture_host_rows // self.block_tokens)
        deltas = plan.capture_rope_deltas if len(plan.capture_rope_deltas) else None
        self.current = self._new(slots, plan.capture_host_rows, deltas, paged=True)
        return check

    def begin_found(self, plan: StepPlan, found: np.ndarray, rows: np.ndarray, device: torch.device) -> None:
        """Capture the planned rows found in this batch (`rows`: their batch
        rows); planned slots absent from the batch fail their host slot."""
        if not found.all():
            self.fail_rows(plan.capture_host_rows[~found], "rows missing from the batch")
        if not len(rows):
            return
        deltas = plan.capture_rope_deltas[found] if len(plan.capture_rope_deltas) else None
        paged = self.cache_views is not None  # read from the caches after the forward, by paged slot
        if paged and not self.views_checked:
            self._check_rows = to_device(rows, device)
        rows = plan.capture_paged_slots[found] if paged else rows
        self.current = self._new(to_device(rows, device), plan.capture_host_rows[found], deltas, paged)

    def first_layer(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """At the forward's first layer: keep what it wrote to check the views against."""
        if self._check_rows is not None:
            rows, self._check_rows = self._check_rows, None
            self.current.expect(layer_idx, key.index_select(0, rows), value.index_select(0, rows))

    def take(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """A layer's K/V as the attention hook hands them (layer-by-layer captures)."""
        if self.layer_by_layer:
            self.current.take(layer_idx, key, value)

    def flush(self, plan: StepPlan, forward_begun: bool) -> list[SlotCheck]:
        """After the forward: the captured rows of every layer into their host
        rows (on CUDA asynchronously). A capture that missed a layer fails its
        slots, and so do the planned rows of a step whose forward never
        reached the attention hook (e.g. vLLM replayed the KV-cache update
        from a CUDA graph). Returns what the device still has to tell the
        step's report: under fp8 on CUDA, whether each stored block was
        finite (a block that was not fails its slot there)."""
        capture, self.current = self.current, None
        if not forward_begun and len(plan.capture_host_rows):
            self.fail_rows(plan.capture_host_rows, "the attention hook never saw this step's forward: "
                           "is the KV-cache update captured in a CUDA graph?")
            return []
        if capture is not None and capture.paged:
            if capture.gather(*self.cache_views, self.rope):
                self.views_checked = True
            else:
                logger.warning("sekv: the paged KV cache does not read back what the attention layer wrote "
                               "(an unexpected layout); capturing through the attention hook from now on")
                self.cache_views = None
        if capture is None:
            return []
        if not self.writer.write(capture, self.rope):
            self.fail_rows(capture.host_rows, "a layer's K/V never reached the capture")
            return []
        bad = self.pool.take_failed_slots()  # fp8: non-finite K/V, or a block whose earlier rows are gone
        if bad:
            self.failed_slots |= bad
            self.count_dropped(len(bad), "fp8 blocks with non-finite K/V or lost rows")
        flags = self.writer.take_flags()  # fp8 on CUDA: the same, from the device
        return [] if flags is None else [SlotCheck(*flags, NON_FINITE, self.writer.stream)]

    def fail_rows(self, host_rows: np.ndarray, why: str) -> None:
        """Fail the host slots of `host_rows` in this step's report: their
        blocks are never committed (misses, recomputed)."""
        lost = set((host_rows // self.block_tokens).tolist())
        self.failed_slots |= lost
        self.count_dropped(len(lost), why)

    def count_dropped(self, blocks: int, why: str) -> None:
        self.stats.add("capture_failures", blocks)
        logger.warning("sekv: %d captured blocks dropped (%s)", blocks, why)

    def take_failed(self) -> set[int]:
        failed, self.failed_slots = self.failed_slots, set()
        return failed

    def _new(self, rows: torch.Tensor, host_rows: np.ndarray, deltas: np.ndarray | None,
             paged: bool) -> StepCapture:
        """A capture of `rows` (batch rows; paged slots if `paged`) into
        `host_rows`, keys moved by `deltas` (None or all zero: not moved)."""
        deltas = to_device(deltas, rows.device) if deltas is not None and deltas.any() else None
        self.stats.add("captured_tokens", len(host_rows))
        geo = self.geometry
        return StepCapture(rows, host_rows, deltas, geo.num_layers, geo.kv_heads, geo.head_dim,
                           self.pool.dtype, paged)
