"""Worker-side connector: runs the worker's parts in step order.

Runs in each worker process, on the forward thread, in this order per step:
  `bind`           (before the forward) if the step reads the host tier on
                   the host, wait for the last steps' captures to land in it
                   (readers on the device wait there instead,
                   `CaptureWriter.order`); hand NVMe and remote transfers to
                   their threads (`TierTransfers`); index the blocks committed
                   since the last probe (`IndexFeed`);
  `start_load_kv`  restore planned rows through the platform's own
                   cache-update op, keys re-RoPE'd to the view's positions
                   where the plan says so: on CPU, and lossy ones anywhere,
                   blocking, before the forward (`HostRestores`); on CUDA
                   enqueued on a copy stream (`DeviceRestores`), layer by layer
                   (the first copies possibly already enqueued when the
                   scheduler side matched or planned the restore in this
                   process: `head_start_match`, `head_start`) or batched;
  `wait_for_layer_load` (vLLM, and the attention hook as a safety net) before
                   each layer's attention: a layerwise restore writes that
                   layer and enqueues the copy of a later one; never blocks;
  `capture_kv`     called by the attention hook right after the platform
                   wrote a layer's K/V: at the first layer finds the planned
                   rows in the batch; for a layer-by-layer capture, at every
                   layer, keeps them on the device (`ForwardCapture`);
  `observe_queries` called by the attention hook once per layer before
                   attention: a probe's queries score candidate blocks of the
                   index (`ProbeScorer`);
  (SeKV, `surprisal` on) after the model's forward, a hook records the
                   surprisal of the step's captured tokens (`SurprisalRecorder`);
  `build_worker_meta` after the forward: stores the step's captured rows into
                   the host pool (on CUDA asynchronously), writes any layer a
                   layerwise restore still holds (the cache never keeps stale
                   KV), reports the step as done, with capture failures,
                   restore times and the tier transfers finished so far.
Only the host slots named by the plan are written. A capture row missing from
the batch fails its slot: the scheduler side then never commits it.

On CUDA no step waits for the GPU unless it reads the host tier on the host,
probes, or builds coarse summaries: what only the device knows at report
time (a restore's transfer time; whether a paged capture's slots were in the
batch) travels in the report unread and is read with it (`device_reports`).
"""
from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from vllm_sekv import compat, model_identity
from vllm_sekv.config import SekvConfig
from vllm_sekv.worker_side.coarse_attention import CoarseAttention, StepRows
from vllm_sekv.protocol.metadata import SekvMetadata, SekvWorkerMeta, host_slots, keeps_cache_bytes
from vllm_sekv.protocol import head_start
from vllm_sekv.worker_side.device_reports import RestoreTiming, SlotCheck, count_settled
from vllm_sekv.worker_side.index_feed import IndexFeed
from vllm_sekv.worker_side.forward_capture import ForwardCapture, fp8_cache_params
from vllm_sekv.worker_side.host_restores import HostRestores, restore_ranks
from vllm_sekv.worker_side.probes import ProbeScorer
from vllm_sekv.worker_side.device_restores import DeviceRestores
from vllm_sekv.protocol.stats import SekvStats
from vllm_sekv.worker_side.surprisal import SurprisalRecorder
from vllm_sekv.worker_side.tier_transfers import TierTransfers
from vllm_sekv.store import HostPool, cudart
from vllm_sekv.store.capture import CaptureWriter
from vllm_sekv.index.block_index import BlockIndex
from vllm_sekv.workspace.step_plan import StepPlan
from vllm_sekv.index.router import load_router
from vllm_sekv.index.retrieval_heads import load_heads

logger = logging.getLogger("vllm_sekv")

# With a zoom router the index holds what it was trained on: surprisal-weighted
# mean pre-RoPE keys (here one per block; calibration used surprisal segments).
ROUTER_SUMMARY = "wmean_pre"


class SekvWorkerSide:
    def __init__(self, config: SekvConfig, vllm_config: Any) -> None:
        self.config = config
        self.vllm_config = vllm_config
        self.geometry = model_identity.kv_geometry(vllm_config)
        self.num_slots, _ = host_slots(config, vllm_config)
        self.rope = model_identity.rope_spec(vllm_config)
        self.pool: HostPool | None = None
        self.transfers = TierTransfers(None, None, config.block_tokens)  # NVMe and remote reads and writes
        self.index: BlockIndex | None = None
        self.restores: DeviceRestores | None = None  # CUDA: copy-stream restores from the pinned pool
        # This step's facts still on the device (CUDA restore timings, paged
        # capture checks): its report carries them unread (`device_reports`);
        # `_unsettled` keeps them until they are in, for stats and warnings.
        self._device_reports: list[RestoreTiming | SlotCheck] = []
        self._unsettled: list[RestoreTiming | SlotCheck] = []
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.layer_of: dict[str, int] = {}
        self.stats = SekvStats()
        self._plan: StepPlan | None = None
        self._confirmed_step = -1
        self._restore_seconds: dict[str, float] = {}
        # This step's capture of the planned rows (`ForwardCapture`), stored
        # after the forward by `capture_writer` (asynchronously on CUDA).
        self.capture: ForwardCapture | None = None
        self.capture_writer: CaptureWriter | None = None
        self.host_restores: HostRestores | None = None  # CPU restores, and lossy ones anywhere
        # Whether this step's forward needs `capture_kv` at every layer (the
        # first layer always, where the step's rows are found; later layers
        # for layer-by-layer captures and coarse keys).
        self.capture_layers = False
        # Whether this step needs the attention hook's per-layer calls before
        # and after attention (probes, coarse merges, a layerwise restore).
        self.attention_hooks = False
        # Probes: their queries score the block index (created with the index).
        self.probes: ProbeScorer | None = None
        self.index_feed: IndexFeed | None = None  # blocks waiting for the index
        # SeKV: the model's own surprisal of captured tokens (config `surprisal`).
        self.surprisal: SurprisalRecorder | None = None
        self._read_surprisal: list[tuple[np.ndarray, np.ndarray]] = []  # (host rows, values) read back
        # Whether this step's forward reached its first layer; its slot mapping
        # sorted there when something needs batch rows: (batch row of each
        # sorted slot, the sorted slots).
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

    # ---------------------------------------------------------------- set-up

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        geo = self.geometry
        self.kv_caches = kv_caches
        self.layer_of = {name: compat.layer_index(name) for name in kv_caches}
        layers = sorted(set(self.layer_of.values()))
        if len(layers) != geo.num_layers:
            raise ValueError(f"sekv: expected {geo.num_layers} attention layers, vLLM registered {len(layers)}")
        rank = {layer: i for i, layer in enumerate(layers)}
        self.layer_of = {name: rank[idx] for name, idx in self.layer_of.items()}
        device = next(iter(kv_caches.values())).device
        # an fp8 paged cache's bytes kept as they are: every layer's fixed scales
        fixed = (fp8_cache_params(self.vllm_config, self.layer_of, geo)
                 if keeps_cache_bytes(self.config, self.vllm_config) else None)
        try:
            self.pool = HostPool(self.num_slots, geo.num_layers, self.config.block_tokens, geo.kv_heads,
                                 geo.head_dim, geo.dtype, pin_memory=device.type == "cuda",
                                 codec=self.config.workspace_codec, layer_params=fixed)
        except RuntimeError as e:  # page-locking the tier failed (CUDA), or no memory for it
            raise RuntimeError(f"sekv config 'host_bytes': the host tier of {self.config.host_bytes} bytes "
                               f"could not be allocated and pinned ({e}); lower host_bytes") from e
        self.capture_writer = CaptureWriter(self.pool, device)
        self.capture = ForwardCapture(self.pool, self.capture_writer, geo, self.rope, self.config.block_tokens,
                                      self.stats, kv_caches, self.layer_of)
        if device.type == "cuda":
            if self.config.restore_mode == "layerwise" and not cudart.available():
                raise ValueError("sekv config 'restore_mode': layerwise needs the CUDA runtime library "
                                 "(libcudart) that torch loads, and none was found; use auto or batched")
            self.restores = DeviceRestores(self.pool, self.capture_writer, kv_caches, self.layer_of, geo, self.rope,
                                           self.config.block_tokens, self.config.restore_mode, device,
                                           cudart.available(), self.config.resident_bytes)
            self.restores.warm_up()
            if cudart.available():
                head_start.register(head_start.engine_id(self.vllm_config), self)
        fingerprint = model_identity.router_geometry(self.vllm_config)  # what router and heads files record
        self.router = load_router(self.config, fingerprint)  # None without router_path
        if self.config.coarse == "on":
            self.coarse = CoarseAttention(geo.num_layers, geo.kv_heads, geo.head_dim, geo.dtype, device, self.rope)
        self.host_restores = HostRestores(self.pool, geo, self.rope, self.config.block_tokens, kv_caches,
                                          self.layer_of, restore_ranks(self.config, self.router))
        kind = ROUTER_SUMMARY if self.router is not None else self.config.index_summary
        # On CUDA the index lives on the GPU: probes score where the queries are.
        self.index = BlockIndex(self.num_slots, geo.num_layers, geo.kv_heads, geo.head_dim, self.rope, kind=kind,
                                device=device if device.type == "cuda" else "cpu")
        logger.info("sekv: block index of %d blocks on %s: %.2f GiB (not part of vLLM's gpu_memory_utilization)",
                    self.num_slots, self.index.device, self.index.entries.nbytes / 2**30)
        mc = self.vllm_config.model_config
        self.index.warm_up(mc.get_num_attention_heads(self.vllm_config.parallel_config))
        self.index_feed = IndexFeed(self.index, self.pool, self.capture_writer, self.config.block_tokens)
        view_tokens = self.config.view_tokens or compat.native_window_tokens(self.vllm_config)
        self.probes = ProbeScorer(self.index, self.router, geo, self.rope, self.config.block_tokens,
                                  self.config.index_combine, self.config.rerank_blocks, view_tokens // 2,
                                  self._read_keys, load_heads(self.config, fingerprint))
        if self.config.surprisal == "on":
            model = compat.model_of_caller()
            if model is None:
                raise ValueError("sekv config 'surprisal': cannot reach the model from the KV connector "
                                 "in this vLLM version; use surprisal off")
            self.surprisal = SurprisalRecorder(model)
        self.transfers = TierTransfers.open(self.config, self.vllm_config, self.pool.data, self.pool.scales)

    def _read_keys(self, slots: list[int]) -> torch.Tensor:
        """Keys of whole host slots on the index's device (the re-rank's
        reader); on CUDA ordered after every capture written so far."""
        device = self.index.device
        if device.type == "cuda":
            self.capture_writer.order(torch.cuda.current_stream(device))
        return self.pool.slot_keys_on(slots, device)

    # ------------------------------------------------------------ each step

    def bind(self, metadata: SekvMetadata) -> None:
        plan = self._plan = metadata.plan
        if self.capture_writer is not None:
            if self._reads_pool_on_host(plan):
                self.capture_writer.settle()  # the last steps' captures are in the pool before the host reads it
            else:
                self.capture_writer.reap()  # readers on the device wait there (`CaptureWriter.order`)
        self._step_mapping = self._coarse_rows = None
        if self.capture is not None:
            self.capture.reset()
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
        copies = [c for c in (self.host_restores, self.restores) if c is not None and c.keeps_copies]
        if copies:  # low-rank factors, resident blocks: copies of slots this step rewrites go stale
            rewritten = plan.rewritten_slots(self.config.block_tokens)
            for c in copies:
                c.drop_rewritten(rewritten)
        if self.index_feed is not None:
            self.index_feed.take_plan(plan)
        if self.surprisal is not None:
            self.surprisal.bind(plan.surprisal, self._step_rows)
        self.transfers.submit(plan)
        if self.index_feed is not None:
            self.index_feed.update(plan)

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
                    or (not device_index and (plan.index_blocks or self.index_feed.pending or plan.scores)))

    def start_load_kv(self, forward_context: Any) -> None:
        plan = self._plan
        if plan is None or self.pool is None:
            return
        unhooked = not self._forward_begun and compat.full_graph_replay(forward_context)
        exact = [op for op in plan.restores if not op.lowrank]
        if self.restores is not None and exact:
            checked = self.capture.bytes_checked, self.capture.reads_paged  # the caches' views found as written
            self._device_reports += self.restores.start(forward_context, plan.step_id, exact, *checked)
            if unhooked:
                self._end_layerwise()  # no layer will ask for its KV: all of it before the forward
        row_bytes = self.pool.block_bytes // self.config.block_tokens
        for op in plan.restores:
            if self.restores is None or op.lowrank:
                t0 = time.perf_counter()
                if op.lowrank:
                    moved, self._restored_keys[op.req_id] = self.host_restores.restore_lowrank(forward_context, op)
                else:
                    self.host_restores.restore(forward_context, op.paged_slots, op.host_rows, op.rope_deltas,
                                               cache_bytes=self.capture.bytes_checked)
                    moved = len(op.host_rows) * row_bytes
                self._restore_seconds[op.req_id] = time.perf_counter() - t0
                self.stats.add("restore_seconds", self._restore_seconds[op.req_id])
            else:
                moved = self.restores.account(op.req_id, len(op.host_rows) * row_bytes, self.stats)
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
        from the host pool, on the device) and hand over their restored
        history keys."""
        restores = {op.req_id: op for op in plan.restores}
        device = self.coarse.device  # the pool is read there, after every capture written so far
        if device.type == "cuda" and plan.coarse:
            self.capture_writer.order(torch.cuda.current_stream(device))
        for op in plan.coarse:
            spec = op.summaries
            if spec is None:
                continue
            restore = restores.get(op.req_id)
            history, start = self._restored_keys.pop(op.req_id, None), 0
            if restore is not None:
                start = restore.first_position
                if history is None:
                    history = self.host_restores.exact_rows(restore.host_rows, restore.rope_deltas, device)[0]
            else:
                geo = self.geometry
                history = torch.zeros((geo.num_layers, 0, geo.kv_heads, geo.head_dim))
            self.coarse.begin(op.req_id, spec, lambda rows: self.pool.rows_on(rows, device), history, start)
            self.stats.add("summaries", len(spec.num_tokens))
            self.stats.add("summary_bytes", self.coarse.summary_bytes(op.req_id))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before a layer's attention: its restored KV is in the paged cache
        (on the compute stream). A no-op unless a layerwise restore runs."""
        if self.restores is not None:
            self.restores.load(layer_name)

    def _end_layerwise(self) -> None:
        """Write every layer of this step's layerwise restores the forward did not ask for (the cache never
        keeps stale KV); their timings go in the step's report."""
        if self.restores is not None:
            self._device_reports += self.restores.finish()

    def head_start(self, plan: StepPlan) -> None:
        """The scheduler side (in this process) hands over the plan it just
        built (`protocol.head_start`): a layerwise restore in it enqueues its
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
            self.capture_layers = bool(self._coarse_rows) or self.capture.layer_by_layer  # later layers
            self.capture.first_layer(self.layer_of[layer.layer_name], key, value)  # checks the paged views
        if self._coarse_rows:
            layer_idx = self.layer_of[layer.layer_name]
            for req_id, step in self._coarse_rows:
                self.coarse.keys_written(req_id, layer_idx, key[step.rows], step)
        self.capture.take(self.layer_of[layer.layer_name], key, value)

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
        if self.capture.reads_paged:
            mapping = compat.full_graph_slot_mapping(forward_context, self._slot_mapping_seen, plan.batch_tokens)
        if mapping is None:
            self.capture.fail_rows(plan.capture_host_rows, "a full CUDA graph step with no slot mapping or "
                                   "checked paged cache views at hand")
            return
        self._device_reports.append(self.capture.begin_paged(plan, mapping))

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
        if capture and self.capture.reads_paged and not rows_needed:
            self._device_reports.append(self.capture.begin_paged(plan, slot_mapping))
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
            self.capture.begin_found(plan, *self._step_rows(plan.capture_paged_slots), slot_mapping.device)

    def _step_rows(self, want: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(found [len(want)] bool, batch row of each found paged slot) in this
        step's batch (no mapping yet: nothing found)."""
        if self._step_mapping is None:
            return np.zeros(len(want), dtype=bool), np.zeros(0, dtype=np.int64)
        order, sorted_slots = self._step_mapping
        pos = np.clip(np.searchsorted(sorted_slots, want), 0, max(len(sorted_slots) - 1, 0))
        found = sorted_slots[pos] == want if len(sorted_slots) else np.zeros(len(want), bool)
        return found, order[pos[found]]

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
        if self.capture is not None:
            # before the step is confirmed: then committable
            self._device_reports += self.capture.flush(plan, self._forward_begun)
        self._end_layerwise()
        self._unsettled = count_settled(self._unsettled, self.stats, self.capture)
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
        failed = self.capture.take_failed() if self.capture is not None else set()
        meta = SekvWorkerMeta(self._confirmed_step, failed, self._restore_seconds, io, scores, surprisal,
                              pending=reports,
                              resident_blocks=self.restores.take_placed() if self.restores is not None else {})
        self._restore_seconds = {}
        return meta

    def _drain_io(self) -> list[tuple[str, bytes, bool]]:
        """The NVMe and remote reads and writes finished since the last step,
        for the scheduler side; blocks read back are indexed, their records'
        surprisal kept."""
        io, read_back = self.transfers.drain(self.stats)
        bt = self.config.block_tokens
        for block in read_back:
            self.index_feed.read_back(block)
            if block.surprisal is not None:
                self._read_surprisal.append((block.host_slot * bt + np.arange(bt), block.surprisal))
        return io

    def take_stats(self) -> SekvStats | None:
        if self.stats.is_empty():
            return None
        stats = SekvStats(data=dict(self.stats.data))
        self.stats.reset()  # in place: the step's parts hold it
        return stats

    def shutdown(self) -> None:
        head_start.unregister(head_start.engine_id(self.vllm_config), self)
        self._unsettled = count_settled(self._unsettled, self.stats, self.capture, wait=True)
        if self.capture_writer is not None:
            self.capture_writer.settle()
        self.transfers.close()
