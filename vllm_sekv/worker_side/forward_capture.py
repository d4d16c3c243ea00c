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
  Over an fp8 paged cache (a pool with `layer_params`) the hook instead
  reads the planned slots' bytes from the layer's cache, as vLLM wrote them
  (`byte_views`, `compat.paged_kv_byte_views`); those views are trusted once
  the first capture's bytes, dequantized with the layer scales, agree with
  the attention layer's own K/V within one e4m3 step. Where they do not (an
  unknown layout), the hook's K/V are captured and rounded to the layer
  scales by sekv: the same values within one e4m3 step, not the same bytes.
  So are the rows of a capture that moves keys (a view step's new tokens,
  computed at compact positions; all its rows): rotated from the attention
  layer's own keys and rounded once. Rotating the cache's bytes would round
  them twice, and vLLM's CPU kernels truncate: on SmolLM2 that nearly
  doubles the attention output's error (`benchmarks/results/fp8_codec/`)
  and lost the 16K view's pass key, which one rounding keeps
  (`tests/engine/test_fp8_views.py`).

A planned row that cannot be captured fails its host slot: the block is never
committed (a miss, recomputed), never stale KV. Under `workspace_codec` fp8
so does a slot whose K/V is not finite (`HostPool.take_failed_slots`; on CUDA
a `SlotCheck` the step's report reads from the device). Runs on the forward thread.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from vllm_sekv import compat
from vllm_sekv.protocol.stats import SekvStats
from vllm_sekv.model_identity import KVGeometry
from vllm_sekv.ops import RopeSpec
from vllm_sekv.store import HostPool
from vllm_sekv.store.capture import CaptureWriter, StepCapture
from vllm_sekv.store.fp8 import FP8_DTYPE, FP8_MAX, cache_params
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
    if len(first) != geometry.num_layers or any(t.device.type != "cuda" for t in first.values()):
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


def paged_cache_byte_views(kv_caches: dict[str, torch.Tensor], layer_of: dict[str, int],
                           geometry: KVGeometry) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Every layer's (K, V) uint8 views of its fp8 paged cache, if all layers
    have them (`compat.paged_kv_byte_views`); else None."""
    first: dict[int, torch.Tensor] = {}
    for name, kv_cache in kv_caches.items():
        first.setdefault(layer_of[name], kv_cache)
    if len(first) != geometry.num_layers:
        return None
    views = [compat.paged_kv_byte_views(first[i], geometry.kv_heads, geometry.head_dim)
             for i in range(geometry.num_layers)]
    return None if any(v is None for v in views) else views


def fp8_cache_params(vllm_config: Any, layer_of: dict[str, int], geometry: KVGeometry) -> torch.Tensor:
    """The fixed parameters of an fp8 paged cache's bytes in the pool
    (`store.fp8.cache_params`): each layer's K and V scale, from its first
    named attention layer."""
    first = {idx: name for name, idx in reversed(list(layer_of.items()))}
    scales = compat.kv_cache_scales(vllm_config, [first[i] for i in range(geometry.num_layers)])
    return cache_params([k for k, _ in scales], [v for _, v in scales], geometry.kv_heads, geometry.head_dim)


def same_within_one_step(stored: torch.Tensor, scale: float, exact: torch.Tensor) -> bool:
    """Whether fp8 bytes `stored` (uint8) at `scale` read back as `exact`
    (the model-dtype values they were made from) within one e4m3 step: 2**-3
    of the value, or the subnormal spacing 2**-9 times the scale, after
    clamping to the largest finite e4m3. Any rounding mode passes; bytes of
    other elements (a wrong layout) do not."""
    ref = exact.to(torch.float32).nan_to_num(0.0).clamp(-FP8_MAX * scale, FP8_MAX * scale)
    got = stored.view(FP8_DTYPE).to(torch.float32) * scale
    return bool(((got - ref).abs() <= ref.abs() * 2.0 ** -3 + scale * 2.0 ** -9).all())


class ForwardCapture:
    def __init__(self, pool: HostPool, writer: CaptureWriter, geometry: KVGeometry, rope: RopeSpec,
                 block_tokens: int, stats: SekvStats, kv_caches: dict[str, torch.Tensor],
                 layer_of: dict[str, int]) -> None:
        """`kv_caches`: vLLM's paged caches by layer name, `layer_of` their
        layer indices: read through `paged_cache_views` where they allow it,
        or `paged_cache_byte_views` by a pool over an fp8 paged cache."""
        self.pool = pool
        self.writer = writer
        self.geometry = geometry
        self.rope = rope
        self.block_tokens = block_tokens
        self.stats = stats
        self.current: StepCapture | None = None  # this step's, kept on the device until the forward ends
        self.cache_views = paged_cache_views(kv_caches, layer_of, geometry, pool.dtype)
        self.views_checked = False
        self.byte_views = (paged_cache_byte_views(kv_caches, layer_of, geometry)
                           if pool.layer_params is not None else None)
        self.bytes_checked = False
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
        moved = deltas is not None and bool(deltas.any())
        if self.byte_views is not None and not moved:  # an fp8 cache's bytes, read layer by layer, by slot
            if not self.bytes_checked:
                self._check_rows = to_device(rows, device)
            slots = to_device(plan.capture_paged_slots[found], device)
            self.current = self._new(slots, plan.capture_host_rows[found], deltas, paged=False, cache_bytes=True)
            return
        paged = self.cache_views is not None  # read from the caches after the forward, by paged slot
        if paged and not self.views_checked:
            self._check_rows = to_device(rows, device)
        rows = plan.capture_paged_slots[found] if paged else rows
        self.current = self._new(to_device(rows, device), plan.capture_host_rows[found], deltas, paged)

    def first_layer(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """At the forward's first layer: keep what it wrote to check the views
        against (fp8 cache bytes: check them now)."""
        if self._check_rows is None:
            return
        rows, self._check_rows = self._check_rows, None
        key, value = key.index_select(0, rows), value.index_select(0, rows)
        if not self.current.cache_bytes:
            self.current.expect(layer_idx, key, value)
            return
        self.current.take_bytes(layer_idx, *self.byte_views[layer_idx])
        params = self.pool.layer_params
        if (same_within_one_step(self.current.kv[0, layer_idx], float(params[0, layer_idx, 0, 0]), key)
                and same_within_one_step(self.current.kv[1, layer_idx], float(params[1, layer_idx, 0, 0]), value)):
            self.bytes_checked = True
            return
        logger.warning("sekv: the fp8 paged KV cache does not read back what the attention layer wrote "
                       "(an unexpected layout); rounding the attention layer's K/V to the layer scales from now on")
        self.byte_views = None
        old = self.current
        self.current = StepCapture(rows, old.host_rows, old.deltas, self.geometry.num_layers, self.geometry.kv_heads,
                                   self.geometry.head_dim, self.pool.dtype)

    def take(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """A layer's K/V as the attention hook hands them (layer-by-layer
        captures; fp8 cache bytes: the layer's cache, just written)."""
        if not self.layer_by_layer:
            return
        if self.current.cache_bytes:
            self.current.take_bytes(layer_idx, *self.byte_views[layer_idx])
        else:
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
             paged: bool, cache_bytes: bool = False) -> StepCapture:
        """A capture of `rows` (batch rows; paged slots if `paged` or
        `cache_bytes`) into `host_rows`, keys moved by `deltas` (None or all
        zero: not moved)."""
        deltas = to_device(deltas, rows.device) if deltas is not None and deltas.any() else None
        self.stats.add("captured_tokens", len(host_rows))
        geo = self.geometry
        return StepCapture(rows, host_rows, deltas, geo.num_layers, geo.kv_heads, geo.head_dim,
                           self.pool.dtype, paged, cache_bytes)
