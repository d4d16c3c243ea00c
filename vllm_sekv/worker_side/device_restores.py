"""The worker's restores on the device: planned host rows from the pinned
pool into vLLM's paged caches, keys re-RoPE'd on the device, written by the
platform's own cache-update op (`LayerWriter`) or, batched from an exact
pool once the caches' K/V views are checked, by the scatter kernel.

Two ways, per `restore_mode` (auto: layer by layer when the restored slots
run long enough, `LAYERWISE_MIN_RUN_BLOCKS`):

* layer by layer (`LayerwiseRestore`): `start` enqueues the first layers'
  copies, the forward asks for each layer before its attention (`load`),
  `finish` writes whatever it did not ask for. When the scheduler side runs
  in this process it hands over each step's plan as soon as it is built
  (`protocol.head_start`): `head_start` then enqueues those first copies
  already, under the rest of vLLM's scheduling and input preparation, and
  `start` of that step adopts them. Earlier still, a restore just matched
  begins at `head_start_match`, with a ring deep enough to keep the copy
  engine busy until the forward asks for its first layer; the plan of the
  same step claims it for the request whose restore reads exactly those
  slots, and restores its other requests as a second layerwise job. A head
  start of another step (or other slots) is dropped: the stream its buffers
  belong to waits for its copies;
* batched (`RestorePipeline`): whole slots, every layer written before the
  forward: by the cache-update op, per batch and layer, or, from an exact
  pool once the capture has checked the caches' K/V views (`start`'s
  `cache_views`) and the caches fit the kernel (`paged_views.scatter_views`),
  by one scatter launch per batch into every layer. With `resident_bytes`
  (diff restores) every restore goes batched (`restore_mode` auto;
  layerwise is refused at start-up), and the blocks an earlier restore
  brought stay on the device (`ResidentBlocks`): through the checked views
  they are written from there, all of a restore's in one launch, else
  copied into the staging there; only the others cross PCIe. The worker
  drops the slots each step rewrites (`drop_rewritten`) before any restore
  of the step.

With an fp8 pool (`workspace_codec` fp8) both move the fp8 bytes and the
slots' parameters; `LayerWriter` dequantizes them on the device in one pass
(`ops.dequantize_rerope`: float32, keys rotated, rounded once to the model
dtype) before the platform's cache-update op. A pool of an fp8 paged
cache's own bytes restored layer by layer, once the capture has checked
the caches' byte views (`start`'s `cache_bytes`), writes the bytes into the
pages through those views instead (`LayerWriter`): no conversion. Rows of a block still
incomplete (they wait in a model-dtype tail and the slot's fp8 bytes are not
written yet: a view's most recent tokens) cannot be copied from the pool:
`start` takes them out of the copies (`split_tail_rows`) and writes them
from the tails, every layer before the forward, through the same writer.

Each restore's transfer time travels in the step's report as a
`RestoreTiming` (CUDA events, read when they are in). One instance per
worker, used from the forward thread (vLLM calls the scheduler side there
too when it hands over plans). The layer-by-layer path also runs on CPU
(synchronous copies), where tests drive it, and so does the batched path
(without timings).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from vllm_sekv import compat
from vllm_sekv.worker_side.device_reports import RestoreTiming
from vllm_sekv.store.capture import CaptureWriter
from vllm_sekv.store.host_pool import HostPool, to_device
from vllm_sekv.store.layerwise import LayerwiseRestore
from vllm_sekv.store.resident import ResidentBlocks
from vllm_sekv.store.slot_runs import mean_run_length
from vllm_sekv.store.transfer import RestorePipeline
from vllm_sekv.worker_side.layer_writer import ByteRoute, LayerWriter
from vllm_sekv.worker_side.paged_views import byte_views, scatter_views
from vllm_sekv.worker_side.slot_layout import slot_layout, slot_of_each_run
from vllm_sekv.workspace.step_plan import RestoreOp

# `restore_mode` "auto" goes layerwise when the restored host slots come in
# runs at least this long on average: each pitched copy then moves >= 8 slots'
# layer (>= 256 KiB with 16-token blocks), close to one large copy's speed.
LAYERWISE_MIN_RUN_BLOCKS = 8

# A restore begun at its match (`head_start_match`) copies ahead into a ring
# of up to this many bytes (at least the usual 4 layers): at 64K tokens of
# Llama-3.1-8B 12 layers, enough copies to cover vLLM's block allocation and
# input preparation before the forward asks for layer 0.
MATCH_RING_BYTES = 3 << 30
DEFAULT_RING_LAYERS = 4

logger = logging.getLogger("vllm_sekv")


@dataclass
class HeadStart:
    """Layerwise restores begun before their step's forward.

    `step_id`: the step they are for (None: begun at a match, not yet claimed
    by a plan); `stream`: the stream their buffers were allocated on;
    `jobs`: (the indices of the step's restore ops a job restores, in order,
    the job); a job begun at a match has no ops until a plan claims it."""

    step_id: int | None
    stream: Any
    jobs: list[tuple[list[int], LayerwiseRestore]]


def _uncovered(jobs: list[tuple[list[int], LayerwiseRestore]], num_ops: int) -> list[int]:
    """The indices of a step's `num_ops` restore ops that none of `jobs` restores."""
    covered = {i for indices, _ in jobs for i in indices}
    return [i for i in range(num_ops) if i not in covered]


def split_tail_rows(ops: list[RestoreOp], pool: HostPool) -> tuple[list[RestoreOp], list[RestoreOp]]:
    """(`ops` less their rows in incomplete fp8 blocks, those rows): a device
    restore copies a slot's stored bytes, which such a block does not have
    yet (`HostPool.in_tails`); the host path reads them from the tail. The
    parts keep their op's fields; an op with no row left out is returned as
    it is, one with no row left in is dropped from the first list."""
    device_ops, tail_ops = [], []
    for op in ops:
        tail = pool.in_tails(op.host_rows)
        if not tail.any():
            device_ops.append(op)
            continue
        for mask, into in ((~tail, device_ops), (tail, tail_ops)):
            if mask.any():
                deltas = None if op.rope_deltas is None else op.rope_deltas[mask]
                into.append(replace(op, paged_slots=op.paged_slots[mask], host_rows=op.host_rows[mask],
                                    rope_deltas=deltas))
    return device_ops, tail_ops


class DeviceRestores:
    """A worker's exact restores from its pinned pool (see the module doc).

    `kv_caches` / `layer_of`: vLLM's paged caches by layer name and each
    name's layer index; `capture_writer`: the worker's, whose copies into the
    pool (and its fp8 tails) every restore is ordered after; `layerwise_copies`:
    whether layer-by-layer copies are available (CUDA: libcudart found);
    `resident_bytes`: device memory for blocks kept between batched restores (0: none)."""

    def __init__(self, pool: HostPool, capture_writer: CaptureWriter, kv_caches: dict[str, torch.Tensor],
                 layer_of: dict[str, int], geometry: Any, rope: Any, block_tokens: int, restore_mode: str,
                 device: torch.device, layerwise_copies: bool, resident_bytes: int = 0) -> None:
        self.pool = pool
        self.capture_writer = capture_writer
        self.kv_caches = kv_caches
        self.layer_of = layer_of
        self.geometry = geometry
        self.rope = rope
        self.block_tokens = block_tokens
        self.restore_mode = restore_mode
        self.device = torch.device(device)
        self.layerwise_copies = layerwise_copies
        self.pipeline = RestorePipeline(tuple(pool.data.shape[1:]), pool.data.dtype, device)
        self._copy_stream = getattr(self.pipeline, "copy_stream", None)  # CUDA only
        self.resident: ResidentBlocks | None = None
        if resident_bytes:
            slot_bytes = pool.data[0].numel() * pool.data.element_size()
            if resident_bytes < slot_bytes:
                raise ValueError(f"sekv config 'resident_bytes': {resident_bytes} bytes hold no block "
                                 f"({slot_bytes} bytes each); use 0 or at least {slot_bytes}")
            try:
                self.resident = ResidentBlocks(resident_bytes // slot_bytes, pool.data.shape[1:], pool.data.dtype,
                                               device)
            except torch.OutOfMemoryError as e:  # vLLM gave the device's memory to its own cache
                raise ValueError(f"sekv config 'resident_bytes': {resident_bytes} bytes do not fit beside vLLM's "
                                 "KV cache; lower it or vLLM's --gpu-memory-utilization") from e
        # Per request restored in batches this step: (bytes moved, blocks placed from `resident`).
        self._transfers: dict[str, tuple[int, int]] = {}
        self._placed: dict[str, int] = {}  # accounted this step, for the step's report
        # This step's layer-by-layer restores (one, or two when a head start
        # begun at a match serves one of its requests), each with its
        # requests' shares of its blocks.
        self._jobs: list[tuple[LayerwiseRestore, list[tuple[str, float]]]] = []
        self._head_start: HeadStart | None = None
        self._byte_views = byte_views(kv_caches, layer_of, geometry) if pool.layer_params is not None else None
        # what one scatter launch writes every layer through, for an exact pool (used once the views are checked)
        self._scatter_views = scatter_views(kv_caches, layer_of, geometry, pool.data.dtype) \
            if pool.scales is None else None

    def warm_up(self) -> None:
        """Run each restore path (batched, layer by layer; rotating or not) once on the pool's first
        slots with the restores' own buffers and writers into no paged slot, so that Triton compiles
        their kernels now: it compiles at a kernel's first launch per specialization (dtypes, strides,
        alignment), which took seconds in a server's first fp8 restore. CUDA only; waits for it."""
        if self.device.type != "cuda" or not self.pool.num_slots:
            return
        started, bt = time.monotonic(), self.block_tokens
        try:  # one slot, and enough for a multiple of 16 tokens (integer arguments specialize on that)
            for n in sorted({1, 16 // math.gcd(bt, 16)}):
                slots = np.arange(min(n, self.pool.num_slots))
                nowhere = to_device(np.full(len(slots) * bt, -1, dtype=np.int64), self.device)
                deltas = to_device(np.zeros(len(slots) * bt, dtype=np.int64), self.device)
                for rerope in (True, False):
                    writer = LayerWriter({}, self.geometry, self.rope, rerope)
                    self.pipeline.restore(self.pool.data, slots.tolist(), (), (), nowhere, deltas if rerope else None,
                                          self.rope, write=writer.batch, scales=self.pool.scales)
                    self._warm_up_scatter(slots.tolist(), nowhere, deltas if rerope else None)
                    if self.layerwise_copies:
                        job = self._start_copies(slots)
                        job.write = writer
                        writer.route(nowhere, deltas if rerope else None)
                        job.finish()
            torch.cuda.synchronize(self.device)
        except Exception as e:  # noqa: BLE001 - a restore compiles what it needs at its first launch anyway
            logger.warning("sekv: the restores' warm-up failed (%s); the first restores compile their kernels", e)
            return
        logger.info("sekv: restore kernels ready in %.1f s", time.monotonic() - started)

    def _warm_up_scatter(self, slots: list[int], nowhere: torch.Tensor, deltas: torch.Tensor | None) -> None:
        """The scatter launches of a batched restore through the paged views
        (`start`'s `cache_views`): staged blocks and, with a resident pool,
        blocks placed from it (a second restore of `slots`, which are dropped
        from the pool after)."""
        if self._scatter_views is None:
            return
        for _ in range(1 if self.resident is None else 2):
            self.pipeline.restore(self.pool.data, slots, *self._scatter_views, nowhere, deltas, self.rope,
                                  resident=self.resident)
        if self.resident is not None:
            self.resident.drop(slots)

    @property
    def layerwise(self) -> bool:
        """Whether a layer-by-layer restore runs in this step."""
        return bool(self._jobs)

    def _current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    # ------------------------------------------------------------ head start

    def head_start_match(self, host_slots: np.ndarray) -> None:
        """Enqueue the copies of a layerwise restore of `host_slots` that the
        scheduler side just matched, before vLLM allocates its blocks; the
        plan of the step claims it (`head_start`) or drops it. Nothing if the
        slots go batched; allocation failure only skips it.

        The first restore matched in a scheduling pass keeps the copy engine:
        a second one in the same pass starts nothing (enqueued copies cannot
        be taken back, so replacing the first would waste its copies and
        delay the step's own); the step's plan restores it with the others."""
        if self._head_start is not None and self._head_start.step_id is None:
            return
        self._drop_head_start()
        if not len(host_slots) or not self._goes_layerwise(host_slots):
            return
        layer_bytes = len(host_slots) * self.pool.block_bytes // self.geometry.num_layers
        depth = max(DEFAULT_RING_LAYERS, MATCH_RING_BYTES // max(1, layer_bytes))
        job = self._try_start_copies(host_slots, depth)
        if job is not None:
            self._head_start = HeadStart(None, self._current_stream(), [([], job)])

    def head_start(self, step_id: int, ops: list[RestoreOp]) -> None:
        """Enqueue the first layers' copies of step `step_id`'s layerwise
        restore of `ops` now (less their rows of incomplete fp8 blocks, as
        `start` will). A restore begun at the match is claimed for the
        op that reads exactly its slots, the other ops get a job of their
        own; one no op reads is dropped. Nothing if they go batched;
        allocation failure only skips the head start."""
        ops, _ = split_tail_rows(ops, self.pool)
        if not ops:
            self._drop_head_start()
            return
        _, op_slots, layerwise = self._layout(ops)
        if not layerwise:
            self._drop_head_start()
            return
        jobs: list[tuple[list[int], LayerwiseRestore]] = []
        begun = self._head_start
        if begun is not None and begun.step_id is None:
            match_job = begun.jobs[0][1]
            claimed = next((i for i, slots in enumerate(op_slots)
                            if np.array_equal(slots, match_job.host_slots)), None)
            if claimed is not None:
                jobs.append(([claimed], match_job))
        if not jobs:
            self._drop_head_start()
            begun = None
        stream = begun.stream if begun is not None else self._current_stream()
        rest = _uncovered(jobs, len(ops))
        if rest:
            job = self._try_start_copies(np.concatenate([op_slots[i] for i in rest]), DEFAULT_RING_LAYERS)
            if job is not None:
                jobs.append((rest, job))
        self._head_start = HeadStart(step_id, stream, jobs) if jobs else None

    def _try_start_copies(self, host_slots: np.ndarray, depth: int) -> LayerwiseRestore | None:
        try:
            return self._start_copies(host_slots, depth)
        except torch.cuda.OutOfMemoryError:
            logger.debug("sekv: no device memory for a restore's head start; it starts with its step")
            return None

    def _drop_head_start(self) -> None:
        """Let go of a head start no step adopted."""
        begun, self._head_start = self._head_start, None
        self._release(begun)

    def _release(self, begun: HeadStart | None) -> None:
        """The stream the buffers of `begun` belong to waits for their copies
        before the allocator hands them out again."""
        if begun is not None and begun.stream is not None:
            begun.stream.wait_stream(self._copy_stream)

    def _adopt_head_start(self, step_id: int, op_slots: list[np.ndarray]) -> list[tuple[list[int], LayerwiseRestore]]:
        """The jobs of step `step_id`'s head start, for the current stream,
        when together they restore exactly `op_slots` (the slots of each of
        the step's ops), plus a new job for any op none of them restores;
        any other head start is dropped, and one job restores every op."""
        def restores_exactly(indices: list[int], job: LayerwiseRestore) -> bool:
            return bool(indices) and max(indices) < len(op_slots) and np.array_equal(
                job.host_slots, np.concatenate([op_slots[i] for i in indices]))

        begun, self._head_start = self._head_start, None
        if begun is not None and (begun.step_id != step_id or begun.stream != self._current_stream()
                                  or not all(restores_exactly(*job) for job in begun.jobs)):
            self._release(begun)
            begun = None
        jobs = begun.jobs if begun is not None else []
        rest = _uncovered(jobs, len(op_slots))
        if rest:
            jobs = jobs + [(rest, self._start_copies(np.concatenate([op_slots[i] for i in rest])))]
        return jobs

    # -------------------------------------------------------------- restores

    def _layout(self, ops: list[RestoreOp]) -> tuple[np.ndarray, list[np.ndarray], bool]:
        """(the host slots of `ops`' runs, in order; those of each op; whether
        they restore layer by layer, per `restore_mode`)."""
        op_slots = [slot_of_each_run(op.host_rows // self.block_tokens) for op in ops]
        host_slots = np.concatenate(op_slots)
        return host_slots, op_slots, self._goes_layerwise(host_slots)

    def _goes_layerwise(self, host_slots: np.ndarray) -> bool:
        mode = self.restore_mode
        if mode == "auto":  # the resident pool serves batched restores only
            layerwise = self.resident is None and mean_run_length(host_slots) >= LAYERWISE_MIN_RUN_BLOCKS
            mode = "layerwise" if layerwise else "batched"
        return mode == "layerwise" and self.layerwise_copies  # auto without them: batched

    def _start_copies(self, host_slots: np.ndarray, depth: int = DEFAULT_RING_LAYERS) -> LayerwiseRestore:
        """A layerwise restore of `host_slots` with its first `depth` layers'
        copies enqueued (behind the captures already written); its `write`
        comes later."""
        stream = self._current_stream()
        if stream is not None:
            self.capture_writer.order(stream)  # copy streams wait for it
        job = LayerwiseRestore(self.pool.data, host_slots, None, self.device, depth=depth,
                               copy_stream=self._copy_stream, scales=self.pool.scales)
        job.start()
        return job

    def start(self, forward_context: Any, step_id: int, ops: list[RestoreOp],
              cache_bytes: bool = False, cache_views: bool = False) -> list[RestoreTiming]:
        """Enqueue step `step_id`'s restores of `ops`: layer by layer (their
        first copies possibly begun by a head start) or batched; rows of
        incomplete fp8 blocks are written from their tails now. Returns the
        batched restores' timings (a layerwise one's comes from `finish`).
        `cache_bytes`: the caches' fp8 byte views are checked
        (`ForwardCapture.bytes_checked`); `cache_views`: their K/V views are
        (`ForwardCapture.reads_paged`): batched restores of an exact pool then
        write every layer through them in one scatter launch per batch
        (`paged_views.scatter_views`), resident blocks straight from the
        resident pool, where they fit the kernel."""
        ops, tails = split_tail_rows(ops, self.pool)
        self._write_tails(forward_context, tails)
        if not ops:
            return []
        bt = self.block_tokens
        host_slots, op_slots, layerwise = self._layout(ops)
        if layerwise:
            for indices, job in self._adopt_head_start(step_id, op_slots):
                job_ops = [ops[i] for i in indices]
                rerope = any(op.rope_deltas is not None for op in job_ops)
                writer = job.write = self._writer(forward_context, rerope)
                # the first layers move while their destinations are worked out
                layouts = [slot_layout(op.host_rows, op.paged_slots, op.rope_deltas, bt) for op in job_ops]
                mapping = np.concatenate([m for _, m, _ in layouts])
                deltas = to_device(np.concatenate([d for _, _, d in layouts]), self.device) if rerope else None
                writer.route(to_device(mapping, self.device), deltas,
                             self._byte_route(mapping) if cache_bytes else None)
                shares = [(ops[i].req_id, len(op_slots[i]) / job.num_blocks) for i in indices]
                self._jobs.append((job, shares))
            return []
        self.capture_writer.order(self._current_stream())  # copy streams wait for it
        timings = []
        views = self._scatter_views if cache_views else None
        for op in ops:
            slots, mapping, deltas = slot_layout(op.host_rows, op.paged_slots, op.rope_deltas, bt)
            moves = op.rope_deltas is not None
            write = None if views is not None else self._writer(forward_context, moves).batch
            timed = self.device.type == "cuda"  # timing events: CUDA only
            if timed:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            mapping, deltas = to_device(mapping, self.device), to_device(deltas, self.device) if moves else None
            handle = self.pipeline.restore(self.pool.data, slots.tolist(), *(views or ((), ())), mapping, deltas,
                                           self.rope, write=write, scales=self.pool.scales,
                                           resident=self._resident_for(slots))
            self._transfers[op.req_id] = (handle.num_bytes, handle.placed_blocks)
            if timed:
                end.record()
                timings.append(RestoreTiming(start, end, [(op.req_id, 1.0)]))
        return timings

    def _resident_for(self, slots: np.ndarray) -> ResidentBlocks | None:
        """The resident pool for a batched restore of `slots`, which must be
        distinct (a slot in two runs of an op's rows goes without it)."""
        return self.resident if self.resident is not None and len(np.unique(slots)) == len(slots) else None

    @property
    def keeps_copies(self) -> bool:
        """Whether it keeps copies of host slots (resident blocks) that a rewrite makes stale."""
        return self.resident is not None

    def drop_rewritten(self, host_slots: set[int]) -> None:
        """Before a step's restores: forget the resident copies of the host
        slots the step rewrites (`StepPlan.rewritten_slots`)."""
        if self.resident is not None:
            self.resident.drop(host_slots)

    def account(self, req_id: str, rows_bytes: int, stats: Any) -> int:
        """The bytes this step's restore of `req_id` moves over PCIe
        (`rows_bytes`, its rows' bytes in the pool, unless it went batched);
        the blocks it placed from the resident pool go to `stats`."""
        moved, placed = self._transfers.pop(req_id, (rows_bytes, 0))
        stats.add("resident_blocks", placed)
        if placed:
            self._placed[req_id] = self._placed.get(req_id, 0) + placed
        return moved

    def take_placed(self) -> dict[str, int]:
        """Blocks placed from the resident pool per request since the last call."""
        placed, self._placed = self._placed, {}
        return placed

    def load(self, layer_name: str) -> None:
        """Before a layer's attention: its restored KV is in the paged cache
        (on the compute stream). A no-op unless a layerwise restore runs."""
        if self._jobs and layer_name in self.layer_of:
            layer = self.layer_of[layer_name]
            for job, _ in self._jobs:
                job.load(layer)

    def finish(self) -> list[RestoreTiming]:
        """Write every layer the forward did not ask for (the cache never keeps
        stale KV) and end the step's layerwise restores: their timings (none
        without such a restore, or without timing events on this device)."""
        jobs, self._jobs = self._jobs, []
        timings = []
        for job, shares in jobs:
            job.finish()
            events = job.transfer_events()
            if events is not None:
                timings.append(RestoreTiming(*events, shares))
        return timings

    def _write_tails(self, forward_context: Any, ops: list[RestoreOp]) -> None:
        """Rows of incomplete fp8 blocks (`split_tail_rows`): read from their tails on the host
        (float32) once the captures' copies landed (`settle`), written through a `LayerWriter`."""
        if ops:
            self.capture_writer.settle()
        for op in ops:
            writer = self._writer(forward_context, op.rope_deltas is not None)
            deltas = None if op.rope_deltas is None else to_device(op.rope_deltas, self.device)
            writer.route(to_device(op.paged_slots, self.device), deltas)
            rows = torch.from_numpy(op.host_rows)
            for layer in range(self.geometry.num_layers):
                key, value = self.pool.read_rows(layer, rows, torch.float32)
                writer(layer, to_device(key, self.device), to_device(value, self.device))

    def _byte_route(self, mapping: np.ndarray) -> ByteRoute | None:
        """`mapping` (paged slot per token, -1: skipped) through the caches'
        byte views, for a pool of an fp8 paged cache's bytes (else None)."""
        if self._byte_views is None:
            return None
        tokens = np.flatnonzero(mapping >= 0)
        page_size = next(iter(self._byte_views.values()))[0][0].shape[1]
        return (self._byte_views, to_device(tokens, self.device), to_device(mapping[tokens] // page_size, self.device),
                to_device(mapping[tokens] % page_size, self.device))

    def _writer(self, forward_context: Any, rerope: bool) -> LayerWriter:
        layers: dict[int, list] = {}
        for name, kv_cache in self.kv_caches.items():
            layers.setdefault(self.layer_of[name], []).append(
                (compat.attention_layer(forward_context, name), kv_cache))
        return LayerWriter(layers, self.geometry, self.rope, rerope)
