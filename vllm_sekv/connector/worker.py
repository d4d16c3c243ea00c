"""Worker-side connector: holds the host tier's bytes and the block index,
restores KV into vLLM's paged cache and captures new K/V out of the forward.

Runs in each worker process, on the forward thread, in this order per step:
  `bind`           (before the forward) if the step reads the host tier on
                   the host, wait for the last steps' captures to land in it
                   (readers on the device wait there instead,
                   `CaptureWriter.order`); index the blocks committed since
                   the last probe, in one batch before the next one (a GPU
                   index, on CUDA: every step but restores);
  `start_load_kv`  restore planned rows through the
                   platform's own cache-update op, keys re-RoPE'd to the view's
                   positions where the plan says so. On CPU blocking, before
                   the forward. On CUDA enqueued on a copy stream
                   (`DeviceRestores`): either layer by layer (only the first
                   layers' copies are enqueued here, or already when the
                   scheduler side matched the restore or planned the step,
                   if it runs in this process: `head_start_match`,
                   `head_start`) or batched (every layer written
                   before the forward), per `restore_mode`;
  `wait_for_layer_load` (vLLM, and the attention hook as a safety net) before
                   each layer's attention: a layerwise restore writes that
                   layer and enqueues the copy of a later one; never blocks;
  `capture_kv`     called by the attention hook right after the platform
                   wrote a layer's K/V: at the first layer finds the planned
                   rows in the batch; for a layer-by-layer capture, at every
                   layer, gathers them into the step's device buffer
                   (`StepCapture`; no copy to the host, no synchronization);
  `observe_queries` called by the attention hook once per layer before
                   attention: a probe's queries score candidate blocks of the
                   index (accumulated over the probe's steps; `ProbeScorer`);
  (SeKV, `surprisal` on) after the model's forward, a hook records the
                   surprisal of the step's captured tokens (`SurprisalRecorder`);
  `build_worker_meta` after the forward: stores the step's captured rows of
                   every layer into the host pool, keys rotated to their
                   virtual positions (a paged capture reads them from the
                   paged caches here; `CaptureWriter`: on CUDA pitched
                   device->host copies straight into the pinned pool on a
                   side stream), writes any layer a layerwise restore still
                   holds (the cache never keeps stale KV), reports the step
                   as done, with capture failures, restore times and the NVMe
                   reads and writes finished so far.
Only the host slots named by the plan are written. A capture row missing from
the batch marks its slot failed: the scheduler side then never commits it.

On CUDA no step waits for the GPU unless it reads the host tier on the host,
probes, or builds coarse summaries: what only the device knows at report
time (a restore's transfer time; whether a paged capture's slots were in the
batch, checked on the device) travels in the report unread and is read with
it (`device_reports`). Under asynchronous scheduling the next step is
prepared while this one runs.

With an NVMe tier, `bind` hands the plan's writes (of committed slots) and
reads (into promoted slots) to `RecordIO`'s threads; they never block the
forward. A block read back is indexed when its checked read is drained.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from vllm_sekv import compat
from vllm_sekv.config import ROUTER_CODEC, SekvConfig
from vllm_sekv.connector.coarse import CoarseAttention, StepRows
from vllm_sekv.connector.common import SekvMetadata, SekvWorkerMeta, host_slots, nvme_layout, record_layout
from vllm_sekv.connector import head_start
from vllm_sekv.connector.device_reports import CaptureCheck, RestoreTiming
from vllm_sekv.connector.probes import ProbeScorer
from vllm_sekv.connector.restores import DeviceRestores
from vllm_sekv.connector.stats import SekvStats
from vllm_sekv.connector.surprisal import SurprisalRecorder
from vllm_sekv.ops import rotate_keys
from vllm_sekv.store import HostPool, cudart
from vllm_sekv.store.capture import CaptureWriter, StepCapture
from vllm_sekv.store.host_pool import to_device
from vllm_sekv.store.codecs import LowRankCodec, parse_codec
from vllm_sekv.store.lowrank_tier import LowRankTier
from vllm_sekv.store.nvme import RecordIO
from vllm_sekv.store.remote import RedisStore
from vllm_sekv.store.remote_io import RemoteIO
from vllm_sekv.workspace.block_index import BlockIndex
from vllm_sekv.workspace.plan import RestoreOp, StepPlan
from vllm_sekv.workspace.router import FULL_RANK, load_router
from vllm_sekv.workspace.tenants import tenant_bytes

logger = logging.getLogger("vllm_sekv")

# With a zoom router the index holds what it was trained on: surprisal-weighted
# mean pre-RoPE keys (here one per block; calibration used surprisal segments).
ROUTER_SUMMARY = "wmean_pre"


class SekvWorkerSide:
    def __init__(self, config: SekvConfig, vllm_config: Any) -> None:
        self.config = config
        self.vllm_config = vllm_config
        self.geometry = compat.kv_geometry(vllm_config)
        self.num_slots, _ = host_slots(config, vllm_config)
        self.rope = compat.rope_spec(vllm_config)
        self.pool: HostPool | None = None
        self.records: RecordIO | None = None
        self.remote: RemoteIO | None = None  # the remote tier's reads and writes (config `remote_url`)
        self.index: BlockIndex | None = None
        self.restores: DeviceRestores | None = None  # CUDA: copy-stream restores from the pinned pool
        # This step's facts still on the device (CUDA restore timings, paged
        # capture checks): its report carries them unread (`device_reports`);
        # `_unsettled` keeps them until they are in, for stats and warnings.
        self._device_reports: list[RestoreTiming | CaptureCheck] = []
        self._unsettled: list[RestoreTiming | CaptureCheck] = []
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.layer_of: dict[str, int] = {}
        self.stats = SekvStats()
        self._plan: StepPlan | None = None
        self._confirmed_step = -1
        self._failed_slots: set[int] = set()
        self._restore_seconds: dict[str, float] = {}
        # This step's captured K/V of every layer, kept on the device until the
        # forward ends; then stored by `capture_writer` (asynchronously on CUDA).
        self._capture: StepCapture | None = None
        self.capture_writer: CaptureWriter | None = None
        # Per layer (by index), K and V views of its paged cache where the
        # capture can read them after the forward in one launch (CUDA,
        # `compat.paged_kv_views`); None: captured layer by layer.
        self._cache_views: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        # The views are trusted once a capture read through them matched the
        # attention layer's own K/V; until then a paged capture also keeps its
        # first layer's rows from the hook (batch rows, on the device).
        self._views_checked = False
        self._check_rows: torch.Tensor | None = None
        # Whether this step's forward needs `capture_kv` at every layer (the
        # first layer always, where the step's rows are found; later layers
        # for layer-by-layer captures and coarse keys).
        self.capture_layers = False
        # Whether this step needs the attention hook's per-layer calls before
        # and after attention (probes, coarse merges, a layerwise restore).
        self.attention_hooks = False
        # Probes: their queries score the block index (created with the index).
        self.probes: ProbeScorer | None = None
        # Committed blocks not indexed yet: indexed in one batch when a probe
        # needs the index, never in steps that do not (restores stay lean).
        # slot -> first token's virtual position; a reused slot: its last block
        # counts, so this never holds more than one entry per host slot.
        self._index_pending: dict[int, int] = {}
        # SeKV: the model's own surprisal of captured tokens (config `surprisal`),
        # and per host slot the surprisal the scheduler side sent for indexing.
        self.surprisal: SurprisalRecorder | None = None
        self._index_surprisal: dict[int, np.ndarray] = {}
        self._read_surprisal: list[tuple[np.ndarray, np.ndarray]] = []  # (host rows, values) read back
        # Whether this step's forward reached its first layer, and the step's
        # slot mapping sorted once there, when something needs batch rows:
        # (batch row of each sorted slot, the sorted slots).
        self._forward_begun = False
        self._step_mapping: tuple[np.ndarray, np.ndarray] | None = None
        # The slot mapping the first layer was handed in the last forward
        # that ran the hook: where a full-CUDA-graph step's mapping is read
        # on vLLM 0.26 (`compat.full_graph_slot_mapping`).
        self._slot_mapping_seen: torch.Tensor | None = None
        # SeKV zoom router (config `router_path`): scores probes instead of Mean-K.
        self.router: Any = None
        # SeKV coarse attention (config `coarse`): per view, the summaries of
        # the history it leaves out; this step's rows of each such request:
        # (req_id, batch rows, view positions).
        self.coarse: CoarseAttention | None = None
        self._coarse_rows: list[tuple[str, StepRows]] | None = None
        self._restored_keys: dict[str, torch.Tensor] = {}  # this step: req_id -> [L, n, H, D] written
        # SeKV lowrank copies of host blocks (config `restore_codec`), one tier
        # per rank a restore may ask for (rank -> tier; empty: exact restores).
        self.lowrank: dict[int, LowRankTier] = {}

    # ---------------------------------------------------------------- set-up

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        geo = self.geometry
        self.kv_caches = kv_caches
        self.layer_of = {name: compat.layer_index(name) for name in kv_caches}
        layers = sorted(set(self.layer_of.values()))
        if len(layers) != geo.num_layers:
            raise ValueError(
                f"sekv: expected {geo.num_layers} attention layers, vLLM registered {len(layers)}"
            )
        rank = {layer: i for i, layer in enumerate(layers)}
        self.layer_of = {name: rank[idx] for name, idx in self.layer_of.items()}
        device = next(iter(kv_caches.values())).device
        try:
            self.pool = HostPool(
                self.num_slots,
                geo.num_layers,
                self.config.block_tokens,
                geo.kv_heads,
                geo.head_dim,
                geo.dtype,
                pin_memory=device.type == "cuda",
            )
        except RuntimeError as e:  # page-locking the tier failed (CUDA), or no memory for it
            raise RuntimeError(f"sekv config 'host_bytes': the host tier of {self.config.host_bytes} bytes "
                               f"could not be allocated and pinned ({e}); lower host_bytes") from e
        self.capture_writer = CaptureWriter(self.pool, device)
        self._cache_views = self._paged_views(kv_caches)
        if device.type == "cuda":
            if self.config.restore_mode == "layerwise" and not cudart.available():
                raise ValueError("sekv config 'restore_mode': layerwise needs the CUDA runtime library "
                                 "(libcudart) that torch loads, and none was found; use auto or batched")
            self.restores = DeviceRestores(self.pool, self.capture_writer, kv_caches, self.layer_of, geo, self.rope,
                                           self.config.block_tokens, self.config.restore_mode, device,
                                           layerwise_copies=cudart.available())
            if cudart.available():
                head_start.register(head_start.engine_id(self.vllm_config), self)
        if self.config.router_path:
            if geo.world_size > 1:
                raise ValueError("sekv config 'router_path': the zoom router needs every query head "
                                 "on one rank; tensor parallelism is not supported yet")
            self.router = load_router(self.config, compat.router_geometry(self.vllm_config))
        if self.config.coarse == "on":
            self.coarse = CoarseAttention(geo.num_layers, geo.kv_heads, geo.head_dim, geo.dtype, device, self.rope)
        self.lowrank = {rank: LowRankTier(LowRankCodec(rank), self.config.block_tokens, self.rope)
                        for rank in self._restore_ranks()}
        kind = ROUTER_SUMMARY if self.router is not None else self.config.index_summary
        # On CUDA the index lives on the GPU: probes score where the queries are.
        self.index = BlockIndex(self.num_slots, geo.num_layers, geo.kv_heads, geo.head_dim, self.rope, kind=kind,
                                device=device if device.type == "cuda" else "cpu")
        view_tokens = self.config.view_tokens or compat.native_window_tokens(self.vllm_config)
        self.probes = ProbeScorer(self.index, self.router, geo, self.rope, self.config.block_tokens,
                                  self.config.index_combine, self.config.rerank_blocks, view_tokens // 2,
                                  self._read_keys)
        if self.config.surprisal == "on":
            model = compat.model_of_caller()
            if model is None:
                raise ValueError("sekv config 'surprisal': cannot reach the model from the KV connector "
                                 "in this vLLM version; use surprisal off")
            self.surprisal = SurprisalRecorder(model)
        if self.config.nvme_dir:
            rank = compat.worker_rank()
            try:
                self.records = RecordIO(nvme_layout(self.config, self.vllm_config), self.pool.data,
                                        record_layout(self.config, self.vllm_config, rank),
                                        self.config.nvme_io_threads, sync=self.config.nvme_sync == "on")
            except OSError as e:
                raise ValueError(f"sekv config 'nvme_dir': cannot use {self.config.nvme_dir}: {e}") from e
        if self.config.remote_url:
            store = RedisStore(self.config.remote_url, self.config.remote_io_timeout_ms / 1000,
                               self.config.remote_ttl_s)
            self.remote = RemoteIO(store, self.pool.data, record_layout(self.config, self.vllm_config,
                                                                        compat.worker_rank()),
                                   self.config.remote_prefix, self.config.remote_io_threads)

    def _read_keys(self, slots: list[int]) -> torch.Tensor:
        """Keys of whole host slots on the index's device (the re-rank's
        reader); on CUDA ordered after every capture written so far."""
        device = self.index.device
        if device.type == "cuda":
            self.capture_writer.order(torch.cuda.current_stream(device))
        return self.pool.slot_keys_on(slots, device)

    def _paged_views(self, kv_caches: dict[str, torch.Tensor]) -> tuple[list, list] | None:
        """Every layer's (K, V) paged-cache views, if all layers have them
        with one stride set each (what `ops.gather_rerope` reads); else None."""
        first: dict[int, torch.Tensor] = {}
        for name, kv_cache in kv_caches.items():
            first.setdefault(self.layer_of[name], kv_cache)
        if any(t.device.type != "cuda" for t in first.values()):
            return None
        views = [compat.paged_kv_views(first[i], self.geometry.kv_heads, self.geometry.head_dim)
                 for i in range(self.geometry.num_layers)]
        if any(v is None for v in views):
            return None
        keys, values = [k for k, _ in views], [v for _, v in views]
        if keys[0].dtype != self.pool.data.dtype:
            return None
        for group in (keys, values):
            if any(t.stride() != group[0].stride() or t.shape != group[0].shape for t in group):
                return None
        return keys, values

    # ------------------------------------------------------------ each step

    def bind(self, metadata: SekvMetadata) -> None:
        plan = self._plan = metadata.plan
        if self.capture_writer is not None:
            if self._reads_pool_on_host(plan):
                self.capture_writer.settle()  # the last steps' captures are in the pool before the host reads it
            else:
                self.capture_writer.reap()  # readers on the device wait there (`CaptureWriter.order`)
        self._capture = self._step_mapping = self._coarse_rows = self._check_rows = None
        if self.probes is not None:
            self.probes.clear_step()
        self._forward_begun = False
        self.capture_layers = bool(len(plan.capture_paged_slots) or plan.scores or plan.coarse or plan.surprisal)
        # Set here, not in `start_load_kv`: vLLM 0.32 starts the loads of a step
        # without synchronous ones after its forward (a layerwise restore, which
        # always runs before the forward, turns the hooks on there).
        self.attention_hooks = bool(plan.scores or plan.coarse)
        self._restored_keys = {}
        if self.coarse is not None:
            self.coarse.finish(plan.coarse_finished)
        if self.lowrank:  # slots taking new bytes: their factors are stale
            bt = self.config.block_tokens
            read = (*plan.nvme_reads, *plan.remote_reads)
            for slot in {*np.unique(plan.capture_host_rows // bt).tolist(), *(op.host_slot for op in read)}:
                for tier in self.lowrank.values():
                    tier.drop(slot)
        if self.index is not None and self.index.kind.uses_weights:
            self._index_surprisal.update(plan.index_surprisal)  # one entry per host slot at most
        if self.surprisal is not None:
            self.surprisal.bind(plan.surprisal, self._step_rows)
        if self.records is not None:
            for block_hash in plan.nvme_deletes:
                self.records.delete_now(block_hash)
            for op in plan.nvme_writes:
                self.records.submit_write(op.host_slot, op.block_hash, op.start_token, tenant_bytes(op.tenant),
                                          plan.nvme_write_surprisal.get(op.host_slot))
            for op in plan.nvme_reads:
                self.records.submit_read(op.block_hash, op.host_slot, op.start_token, tenant_bytes(op.tenant))
        if self.remote is not None:
            self.remote.submit_writes([(op.host_slot, op.block_hash, op.start_token, tenant_bytes(op.tenant))
                                       for op in plan.remote_writes])
            self.remote.submit_reads([(op.host_slot, op.block_hash, op.start_token, tenant_bytes(op.tenant))
                                      for op in plan.remote_reads])
        if self.pool is not None:
            self._update_index(plan)

    def _reads_pool_on_host(self, plan: StepPlan) -> bool:
        """Whether this step reads or rewrites host-tier rows on the host:
        restores on CPU and lossy ones, index updates (before probes too) of
        an index on the host, coarse summaries, NVMe reads and writes. CUDA
        restores and a GPU index read through the copy engine, ordered after
        the captures on the device: under asynchronous scheduling such a step
        never waits for the one before it."""
        device_index = self.index is not None and self.index.device.type == "cuda"
        host_restores = self.restores is None or any(op.lowrank for op in plan.restores)
        return bool((plan.restores and host_restores) or plan.coarse or plan.nvme_reads or plan.nvme_writes
                    or plan.remote_reads or plan.remote_writes
                    or (not device_index and (plan.index_blocks or self._index_pending or plan.scores)))

    def _update_index(self, plan: StepPlan) -> None:
        """Index the blocks committed since the last probe, before this step's
        forward (its probes score with them). On the CPU only when a probe
        needs them (restores stay lean); a GPU index takes each block as it is
        committed, so that no probe pays for a long history at once, except in
        a step that restores (the index reads the host tier too, and would
        delay the restore's first copy): the next step takes them."""
        self._index_pending.update(plan.index_blocks)
        gpu_now = self.index.device.type == "cuda" and not plan.restores
        if self._index_pending and (plan.scores or gpu_now):
            latest, self._index_pending = self._index_pending, {}
            surprisal = None
            if self.index.kind.uses_weights:
                nan = np.full(self.config.block_tokens, np.nan, dtype=np.float32)
                surprisal = torch.from_numpy(np.stack([self._index_surprisal.pop(s, nan) for s in latest]))
            if self.index.device.type == "cuda":
                self.capture_writer.order(torch.cuda.current_stream(self.index.device))
            self.index.add_many(self.pool, list(latest), list(latest.values()), surprisal)

    def start_load_kv(self, forward_context: Any) -> None:
        plan = self._plan
        if plan is None or self.pool is None:
            return
        unhooked = not self._forward_begun and compat.full_graph_replay(forward_context)
        exact = [op for op in plan.restores if not op.lowrank]
        if self.restores is not None and exact:
            self._device_reports += self.restores.start(forward_context, plan.step_id, exact)
            if unhooked:
                self._end_layerwise()  # no layer will ask for its KV: all of it before the forward
        row_bytes = self.pool.block_bytes // self.config.block_tokens
        for op in plan.restores:
            if self.restores is None or op.lowrank:
                t0 = time.perf_counter()
                if op.lowrank:
                    moved = self._restore_lowrank(forward_context, op)
                else:
                    self._restore(forward_context, op.paged_slots, op.host_rows, op.rope_deltas)
                    moved = len(op.host_rows) * row_bytes
                self._restore_seconds[op.req_id] = time.perf_counter() - t0
                self.stats.add("restore_seconds", self._restore_seconds[op.req_id])
            else:
                moved = len(op.host_rows) * row_bytes
            self.stats.add("restored_bytes", moved)
            self.stats.add("restored_tokens", len(op.host_rows))
            self.stats.add("restores", 1)
            if op.view_pass == "final":
                self.stats.add("views", 1)
        if self.coarse is not None:
            self._begin_coarse(plan)
        if self.restores is not None and self.restores.layerwise:
            self.attention_hooks = True  # its safety net: `wait_for_layer_load` before each attention
        if unhooked:
            self._begin_unhooked_forward(forward_context)

    def _begin_coarse(self, plan: StepPlan) -> None:
        """Build the summaries of views starting in this step (all layers,
        from the host pool) and hand over their restored history keys."""
        restores = {op.req_id: op for op in plan.restores}
        for op in plan.coarse:
            spec = op.summaries
            if spec is None:
                continue
            restore = restores.get(op.req_id)
            history, start = self._restored_keys.pop(op.req_id, None), 0
            if restore is not None:
                start = restore.first_position
                if history is None:
                    history = self._exact_rows(restore.host_rows, restore.rope_deltas)[0]
            else:
                geo = self.geometry
                history = torch.zeros((geo.num_layers, 0, geo.kv_heads, geo.head_dim))
            keys, values = self.pool.read_rows_all_layers(torch.from_numpy(spec.host_rows))
            self.coarse.begin(op.req_id, spec, keys, values, history, start)
            self.stats.add("summaries", len(spec.num_tokens))
            self.stats.add("summary_bytes", self.coarse.summary_bytes(op.req_id))

    def _exact_rows(self, host_rows: np.ndarray, rope_deltas: np.ndarray | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K (rotated by `rope_deltas`, as a restore writes them) and V of host
        rows, every layer: `[L, n, H, D]` each, on the host."""
        keys, values = self.pool.read_rows_all_layers(torch.from_numpy(host_rows))  # [n, L, H, D]
        if rope_deltas is not None:
            n, num_layers, heads, dim = keys.shape
            keys = rotate_keys(keys.reshape(n, num_layers * heads, dim), torch.from_numpy(rope_deltas),
                               self.rope).reshape(n, num_layers, heads, dim)
        return keys.transpose(0, 1), values.transpose(0, 1)

    def _restore_ranks(self) -> list[int]:
        """The ranks lossy restores use: r for restore_codec "lowrank(r)", the
        router's expand levels for "router" (its full level is exact)."""
        codec = self.config.restore_codec
        if codec == "exact":
            return []
        if codec != ROUTER_CODEC:
            return [parse_codec(codec).rank]
        levels = self.router.rank_levels[1:]
        if any(r != FULL_RANK and r < 1 for r in levels):
            raise ValueError(f"sekv config 'router_path': rank levels {levels} must be ranks >= 1 or "
                             f"{FULL_RANK} (full)")
        return sorted({r for r in levels if r != FULL_RANK})

    def _restore_lowrank(self, forward_context: Any, op: RestoreOp) -> int:
        """Restore `op` with its lossy slots rebuilt on the device from their
        low-rank factors (each slot at its rank, encoded on first use over its
        pieces and kept on the host), the rest moved exact; every layer at
        once, through the platform's cache-update op. Returns the bytes moved
        (factors + exact rows)."""
        bt = self.config.block_tokens
        n = len(op.host_rows)
        deltas = op.rope_deltas if op.rope_deltas is not None else np.zeros(n, dtype=np.int64)
        virtual = op.first_position + np.arange(n, dtype=np.int64) - deltas
        slots = op.host_rows // bt
        held, row_slot = np.unique(slots, return_inverse=True)  # per block, not per row
        row_rank = np.array([op.lowrank[s].rank if s in op.lowrank else 0 for s in held.tolist()],
                            dtype=np.int64)[row_slot]
        lossy = row_rank > 0
        for slot in np.unique(slots[lossy]).tolist():
            block = op.lowrank[slot]
            tier = self.lowrank[block.rank]
            if tier.pieces_of(slot) != block.pieces:
                i = int(np.argmax(slots == slot))
                tier.encode_block(self.pool, slot, int(virtual[i] - op.host_rows[i] % bt), block.pieces)
        device = next(iter(self.kv_caches.values())).device
        geo = self.geometry
        keys = torch.empty((geo.num_layers, n, geo.kv_heads, geo.head_dim), dtype=self.pool.data.dtype, device=device)
        values = torch.empty_like(keys)
        exact = np.nonzero(~lossy)[0]
        moved = len(exact) * (self.pool.block_bytes // bt)
        if len(exact):
            k, v = self._exact_rows(op.host_rows[exact], deltas[exact] if op.rope_deltas is not None else None)
            keys[:, exact], values[:, exact] = k.to(device, keys.dtype), v.to(device)
        for rank in np.unique(row_rank[lossy]).tolist():  # rotated straight to the view positions
            rows = row_rank == rank
            k, v, moved_rank = self.lowrank[rank].decode_rows(op.host_rows[rows], virtual[rows] + deltas[rows], device)
            where = torch.from_numpy(np.nonzero(rows)[0]).to(device)
            keys[:, where], values[:, where] = k, v
            moved += moved_rank
        self._restored_keys[op.req_id] = keys
        paged_slots = torch.from_numpy(op.paged_slots).to(device)
        for name, kv_cache in self.kv_caches.items():
            layer = compat.attention_layer(forward_context, name)
            idx = self.layer_of[name]
            layer.impl.write_kv(layer, keys[idx], values[idx], kv_cache, paged_slots)
        return moved

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before a layer's attention: its restored KV is in the paged cache
        (on the compute stream). A no-op unless a layerwise restore runs."""
        if self.restores is not None:
            self.restores.load(layer_name)

    def _end_layerwise(self) -> None:
        """Write every layer of this step's layerwise restores the forward did
        not ask for (the cache never keeps stale KV); their timings go in the
        step's report."""
        if self.restores is not None:
            self._device_reports += self.restores.finish()

    def _restore(
        self,
        forward_context: Any,
        paged_slots: np.ndarray,
        host_rows: np.ndarray,
        rope_deltas: np.ndarray | None,
    ) -> None:
        rows = torch.from_numpy(host_rows)
        deltas = None if rope_deltas is None else torch.from_numpy(rope_deltas)
        for name, kv_cache in self.kv_caches.items():
            layer = compat.attention_layer(forward_context, name)
            key, value = self.pool.read_rows(self.layer_of[name], rows)
            if deltas is not None:
                key = rotate_keys(key, deltas, self.rope)
            slots = torch.from_numpy(paged_slots).to(kv_cache.device)
            layer.impl.write_kv(layer, key.to(kv_cache.device), value.to(kv_cache.device), kv_cache, slots)

    def head_start(self, plan: StepPlan) -> None:
        """The scheduler side (in this process) hands over the plan it just
        built (`connector.head_start`): a layerwise restore in it enqueues its
        first copies now (`DeviceRestores.head_start`)."""
        if self.restores is not None:
            self.restores.head_start(plan.step_id, [op for op in plan.restores if not op.lowrank])

    def head_start_match(self, host_slots: np.ndarray) -> None:
        """The scheduler side (in this process) just matched a restore of
        `host_slots`: its copies begin now, before vLLM allocates the request's
        blocks (`DeviceRestores.head_start_match`); the step's plan claims them."""
        if self.restores is not None:
            self.restores.head_start_match(host_slots)

    def capture_kv(
        self, layer: Any, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        if not self._forward_begun:  # the forward's first layer
            if self._plan is None or self.pool is None:
                return
            self._forward_begun = True
            self._begin_forward(key, slot_mapping)
            layerwise = self._capture is not None and not self._capture.paged
            self.capture_layers = bool(self._coarse_rows) or layerwise  # later layers
            if self._check_rows is not None:  # paged views not trusted yet: what this layer wrote
                rows, self._check_rows = self._check_rows, None
                self._capture.expect(self.layer_of[layer.layer_name], key.index_select(0, rows),
                                     value.index_select(0, rows))
        if self._coarse_rows:
            layer_idx = self.layer_of[layer.layer_name]
            for req_id, step in self._coarse_rows:
                self.coarse.keys_written(req_id, layer_idx, key[step.rows], step)
        if self._capture is not None and not self._capture.paged:
            self._capture.take(self.layer_of[layer.layer_name], key, value)

    def _begin_unhooked_forward(self, forward_context: Any) -> None:
        """Before a forward that replays a full CUDA graph (vLLM's decode
        batches): no attention hook will run, so what it does at the first
        layer happens here. A paged capture takes the step's slot mapping
        from vLLM (`compat.full_graph_slot_mapping`) and checks its slots on
        the device as in any step; with no mapping at hand, or cache views
        no piecewise step has checked yet, the planned rows fail (misses,
        recomputed). Probes see no query: one that ends here reports what
        its earlier steps scored (nothing: the view takes recent blocks).
        Coarse merges and surprisal need every layer of every step: with
        them on, sekv keeps vLLM on piecewise graphs
        (`SekvConnector.requires_piecewise_for_cudagraph`)."""
        plan = self._plan
        self._forward_begun = True
        if plan.scores and self.probes is not None:
            self.probes.unobserved(plan.scores)
        if not len(plan.capture_paged_slots):
            return
        mapping = None
        if self._views_checked and self._cache_views is not None:
            mapping = compat.full_graph_slot_mapping(forward_context, self._slot_mapping_seen, plan.batch_tokens)
        if mapping is None:
            self._fail_rows(plan.capture_host_rows, "a full CUDA graph step with no slot mapping or "
                            "checked paged cache views at hand")
            return
        self._capture = self._paged_capture(plan, mapping)

    def _begin_forward(self, key: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Once per forward, at its first layer: where the plan's rows sit in
        this batch (one slot mapping serves every layer). The mapping is read
        on the host, a device synchronization, only when something needs
        batch rows: probes, coarse rows, a layer-by-layer capture, the first
        paged capture (it checks the cache views), SeKV surprisal. Otherwise a
        paged capture checks its slots against the batch on the device
        (`CaptureCheck`): a decode step never waits for the GPU."""
        plan = self._plan
        self._slot_mapping_seen = slot_mapping
        capture = len(plan.capture_paged_slots) > 0
        rows_needed = bool(plan.scores or plan.coarse or plan.surprisal)
        if capture and self._views_checked and self._cache_views is not None and not rows_needed:
            self._capture = self._paged_capture(plan, slot_mapping)
            return
        mapping = slot_mapping.cpu().numpy()
        order = np.argsort(mapping, kind="stable")
        self._step_mapping = (order, mapping[order])
        if plan.scores and self.probes is not None:
            self.probes.begin(plan.scores, self._step_rows, slot_mapping.device)
        if plan.coarse and self.coarse is not None:
            self._coarse_rows = []
            for op in plan.coarse:
                found, rows = self._step_rows(op.query_paged_slots)
                self._coarse_rows.append((op.req_id, StepRows.of(rows, op.query_positions[found], key.device)))
        if capture:
            self._capture = self._resolve_capture(plan, slot_mapping.device)

    def _flush_captures(self) -> None:
        """After the forward: this step's captured rows of every layer into
        their host rows, keys rotated to their virtual positions (on CUDA
        asynchronously; `bind` settles them before the next step). A capture
        that missed a layer fails its slots, and so do the planned rows of a
        step whose forward never reached the attention hook (e.g. vLLM
        replayed the KV-cache update from a CUDA graph): those blocks are
        never committed, so they are misses, never stale KV."""
        capture, self._capture = self._capture, None
        if not self._forward_begun and len(self._plan.capture_host_rows):
            self._fail_rows(self._plan.capture_host_rows, "the attention hook never saw this step's forward: "
                            "is the KV-cache update captured in a CUDA graph?")
            return
        if capture is not None and capture.paged:
            if capture.gather(*self._cache_views, self.rope):
                self._views_checked = True
            else:
                logger.warning("sekv: the paged KV cache does not read back what the attention layer wrote "
                               "(an unexpected layout); capturing through the attention hook from now on")
                self._cache_views = None
        if capture is None or self.capture_writer.write(capture, self.rope):
            return
        self._fail_rows(capture.host_rows, "a layer's K/V never reached the capture")

    def _fail_rows(self, host_rows: np.ndarray, why: str) -> None:
        """Fail the host slots of `host_rows` in this step's report: their
        blocks are never committed (misses, recomputed)."""
        lost = set((host_rows // self.config.block_tokens).tolist())
        self._failed_slots |= lost
        self._count_dropped(len(lost), why)

    def _count_dropped(self, blocks: int, why: str) -> None:
        self.stats.add("capture_failures", blocks)
        logger.warning("sekv: %d captured blocks dropped (%s)", blocks, why)

    def _step_rows(self, want: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(found [len(want)] bool, batch row of each found paged slot) in this
        step's batch (no mapping yet: nothing found)."""
        if self._step_mapping is None:
            return np.zeros(len(want), dtype=bool), np.zeros(0, dtype=np.int64)
        order, sorted_slots = self._step_mapping
        pos = np.clip(np.searchsorted(sorted_slots, want), 0, max(len(sorted_slots) - 1, 0))
        found = sorted_slots[pos] == want if len(sorted_slots) else np.zeros(len(want), bool)
        return found, order[pos[found]]

    def _resolve_capture(self, plan: StepPlan, device: torch.device) -> StepCapture | None:
        """The capture of this forward's planned rows (None: none in the
        batch). Planned slots absent from the batch fail their host slot."""
        found, rows = self._step_rows(plan.capture_paged_slots)
        if not found.all():
            self._fail_rows(plan.capture_host_rows[~found], "rows missing from the batch")
        if not len(rows):
            return None
        deltas = plan.capture_rope_deltas[found] if len(plan.capture_rope_deltas) else None
        paged = self._cache_views is not None  # read from the caches after the forward, by paged slot
        if paged and not self._views_checked:
            self._check_rows = to_device(rows, device)
        rows = plan.capture_paged_slots[found] if paged else rows
        return self._new_capture(to_device(rows, device), plan.capture_host_rows[found], deltas, paged)

    def _paged_capture(self, plan: StepPlan, slot_mapping: torch.Tensor) -> StepCapture:
        """The capture of every planned row, read from the paged caches after
        the forward; whether the batch wrote each planned slot is checked on
        the device (`CaptureCheck`, in the step's report): a slot it did not
        write fails its host slot there, never committed."""
        slots = to_device(plan.capture_paged_slots, slot_mapping.device)
        self._device_reports.append(
            CaptureCheck(slots, slot_mapping, plan.capture_host_rows // self.config.block_tokens))
        deltas = plan.capture_rope_deltas if len(plan.capture_rope_deltas) else None
        return self._new_capture(slots, plan.capture_host_rows, deltas, paged=True)

    def _new_capture(self, rows: torch.Tensor, host_rows: np.ndarray, deltas: np.ndarray | None,
                     paged: bool) -> StepCapture:
        """A capture of `rows` (batch rows; paged slots if `paged`) into
        `host_rows`, keys moved by `deltas` (None or all zero: not moved)."""
        deltas = to_device(deltas, rows.device) if deltas is not None and deltas.any() else None
        self.stats.add("captured_tokens", len(host_rows))
        geo = self.geometry
        return StepCapture(rows, host_rows, deltas, geo.num_layers, geo.kv_heads, geo.head_dim,
                           self.pool.data.dtype, paged)

    def merge_coarse(self, layer: Any, query: torch.Tensor, output: torch.Tensor, scale: float) -> None:
        """After a layer's attention: merge SeKV summaries into the output
        rows of this step's coarse requests (in place)."""
        if not self._coarse_rows or self.coarse is None:
            return
        head_dim = self.geometry.head_dim
        layer_idx = self.layer_of[layer.layer_name]
        q = query.view(query.shape[0], -1, head_dim)
        out = output.view(output.shape[0], -1, head_dim)
        merged = sum(self.coarse.merge(req_id, layer_idx, q, out, step, scale) for req_id, step in self._coarse_rows)
        self.stats.add("coarse_rows", merged)

    def observe_queries(self, layer: Any, query: torch.Tensor) -> None:
        """A layer's queries (post-RoPE, as attention receives them): the
        step's probes score their candidates with them (`ProbeScorer`)."""
        if self.probes is not None and self.probes.active:
            self.probes.observe(self.layer_of[layer.layer_name], query)

    def build_worker_meta(self) -> SekvWorkerMeta | None:
        plan = self._plan
        if plan is None:
            return None
        self._flush_captures()  # before the step is confirmed: its blocks may then be committed
        self._end_layerwise()
        self._count_device_reports()
        reports, self._device_reports = self._device_reports, []
        self._unsettled += reports
        self._confirmed_step = max(self._confirmed_step, plan.step_id)
        io = self._drain_io()
        parts, self._read_surprisal = self._read_surprisal, []  # blocks read back: their records' surprisal
        if self.surprisal is not None:
            recorded = self.surprisal.take()
            if recorded is not None:
                self.stats.add("surprisal_tokens", len(recorded[0]))
                parts.append(recorded)
        surprisal = None
        if parts:
            surprisal = (np.concatenate([r for r, _ in parts]), np.concatenate([v for _, v in parts]))
        scores = self.probes.take_done() if self.probes is not None else {}
        if scores:
            self.stats.add("probes", len(scores))
        meta = SekvWorkerMeta(self._confirmed_step, self._failed_slots, self._restore_seconds,
                              io, scores, surprisal, pending=reports)
        self._failed_slots, self._restore_seconds = set(), {}
        return meta

    def _count_device_reports(self, wait: bool = False) -> None:
        """Stats and warnings of the device facts that are in (with `wait`:
        of every one, waiting for them); the rest wait for a later step."""
        waiting = []
        for fact in self._unsettled:
            if not (wait or fact.ready()):
                waiting.append(fact)
            elif isinstance(fact, RestoreTiming):
                self.stats.add("restore_seconds", fact.seconds())
            elif fact.failed():  # the report carries the slots; here only counted
                self._count_dropped(len(fact.failed()), "rows missing from the batch")
        self._unsettled = waiting

    def _drain_io(self) -> list[tuple[str, bytes, bool]]:
        """The NVMe and remote reads and writes finished since the last step:
        (kind, block hash, ok) for the scheduler side; blocks read back are
        indexed, their records' surprisal kept."""
        done = (self.records.drain() if self.records is not None else []) + (
            self.remote.drain() if self.remote is not None else [])
        out = []
        for c in done:
            tier = "remote" if c.kind.startswith("remote") else "nvme"
            if c.ok and c.kind.endswith("read"):
                self._index_pending[c.host_slot] = c.start_token
                if c.surprisal is not None and len(c.surprisal) == self.config.block_tokens:
                    rows = c.host_slot * self.config.block_tokens + np.arange(self.config.block_tokens)
                    self._read_surprisal.append((rows, c.surprisal))
                    if self.index is not None and self.index.kind.uses_weights:
                        self._index_surprisal[c.host_slot] = c.surprisal
                self.stats.add(f"{tier}_read_blocks", 1)
            elif c.ok:
                self.stats.add(f"{tier}_written_blocks", 1)
            else:
                self.stats.add(f"{tier}_failures", 1)
                logger.warning("sekv %s: %s of block %s failed (%s); it is a miss and will be recomputed",
                               tier, c.kind.removeprefix("remote_"), c.block_hash.hex()[:16], c.reason)
            out.append((c.kind, c.block_hash, c.ok))
        return out

    def take_stats(self) -> SekvStats | None:
        if self.stats.is_empty():
            return None
        stats, self.stats = self.stats, SekvStats()
        return stats

    def shutdown(self) -> None:
        head_start.unregister(head_start.engine_id(self.vllm_config), self)
        self._count_device_reports(wait=True)
        if self.capture_writer is not None:
            self.capture_writer.settle()
        for io in (self.records, self.remote):
            if io is not None:
                io.drain(wait=True)
                io.close()
