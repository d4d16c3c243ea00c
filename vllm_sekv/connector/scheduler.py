"""Scheduler-side connector: translates vLLM's scheduler calls for the planner.

Runs in the engine-core process on the scheduler thread. Owns the catalog,
the sessions and the planner (bookkeeping only; the bytes are in the workers),
and, with an NVMe tier, the folder's lock and manifest. Every call is blocking
and cheap. The manifest is rewritten whenever a request of a named session
finishes, so a server killed at any point has listed every session it served
(the whole file is rewritten: fine for thousands of sessions; a per-session
journal is the next step for more).
"""
from __future__ import annotations

import logging
from typing import Any

from vllm_sekv import compat
from vllm_sekv.config import SekvConfig
from vllm_sekv.connector import head_start
from vllm_sekv.connector.common import SekvMetadata, SekvWorkerMeta
from vllm_sekv.connector.views import ViewCoordinator
from vllm_sekv.store import HostPool, Tier, make_policy
from vllm_sekv.store.nvme import DirLock, NvmeLayout, folder_name, record_bytes
from vllm_sekv.workspace.catalog import BlockCatalog
from vllm_sekv.workspace.manifest import ManifestError, read_manifest, write_manifest
from vllm_sekv.workspace.planner import WorkspacePlanner
from vllm_sekv.workspace.sessions import SessionTable

logger = logging.getLogger("vllm_sekv")


def block_bytes_per_rank(config: SekvConfig, vllm_config: Any) -> int:
    geo = compat.kv_geometry(vllm_config)
    return HostPool.bytes_per_block(
        geo.num_layers, config.block_tokens, geo.kv_heads, geo.head_dim, geo.dtype
    )


def host_slots(config: SekvConfig, vllm_config: Any) -> tuple[int, int]:
    """(number of host slots, bytes per block over all ranks) under `host_bytes`."""
    block_bytes = block_bytes_per_rank(config, vllm_config) * compat.kv_geometry(vllm_config).world_size
    num_slots = config.host_bytes // block_bytes
    if num_slots < 1:
        raise ValueError(
            f"sekv config 'host_bytes': {config.host_bytes} bytes cannot hold one block "
            f"of {config.block_tokens} tokens ({block_bytes} bytes for this model)"
        )
    return num_slots, block_bytes


def nvme_layout(config: SekvConfig, vllm_config: Any) -> NvmeLayout:
    fingerprint = compat.model_fingerprint(vllm_config, config.block_tokens)
    return NvmeLayout(config.nvme_dir, folder_name(fingerprint))


class SekvSchedulerSide:
    def __init__(self, config: SekvConfig, vllm_config: Any, kv_cache_config: Any = None) -> None:
        num_slots, block_bytes = host_slots(config, vllm_config)
        world_size = compat.kv_geometry(vllm_config).world_size
        self.sessions = SessionTable()
        self.nvme: NvmeLayout | None = None
        self._lock: DirLock | None = None
        self._fingerprint = compat.model_fingerprint(vllm_config, config.block_tokens)
        self._engine_id = head_start.engine_id(vllm_config)
        num_records, found = 0, []
        if config.nvme_dir:
            num_records, found = self._open_nvme(config, vllm_config, world_size)
        self.catalog = BlockCatalog(
            num_slots,
            make_policy(config.policy, num_slots, config.protected_percent),
            num_records,
            make_policy(config.policy, num_records, config.protected_percent),
        )
        for info in found:
            self.catalog.add_stored(info.block_hash, info.start_token)
        self.planner = WorkspacePlanner(
            self.catalog,
            self.sessions,
            block_tokens=config.block_tokens,
            paged_block_size=compat.kv_cache_block_size(vllm_config),
            min_restore_tokens=config.min_restore_tokens,
            world_size=world_size,
            probe_query_tokens=config.probe_query_tokens,
            record_surprisal=config.surprisal == "on",
        )
        self.views = ViewCoordinator(
            config,
            self.planner,
            window_tokens=compat.native_window_tokens(vllm_config),
            capacity_tokens=compat.kv_capacity_tokens(kv_cache_config, vllm_config),
        )
        self._requests: dict[str, Any] = {}
        self._matches_offered: set[str] = set()  # requests whose match went to `head_start.offer_match`
        # kv_transfer_params already handed to vLLM for finished requests,
        # completed when the worker reports their last step (see
        # `update_connector_output`).
        self._open_params: dict[str, dict[str, Any]] = {}
        logger.info(
            "sekv: host tier of %d blocks x %d tokens (%.1f MiB per block)%s",
            num_slots, config.block_tokens, block_bytes / 2**20,
            f", NVMe tier of {num_records} blocks in {self.nvme.root} "
            f"({self.catalog.num_nvme_used} found)" if self.nvme else "",
        )

    def _open_nvme(self, config: SekvConfig, vllm_config: Any, world_size: int) -> tuple[int, list]:
        layout = nvme_layout(config, vllm_config)
        try:
            layout.create()
        except OSError as e:
            raise ValueError(f"sekv config 'nvme_dir': cannot use {config.nvme_dir}: {e}") from e
        self._lock = DirLock(layout.lock_path).acquire()
        layout.clear_tmp()
        per_block = record_bytes(block_bytes_per_rank(config, vllm_config)) * world_size
        num_records = config.nvme_bytes // per_block
        if num_records < 1:
            raise ValueError(
                f"sekv config 'nvme_bytes': {config.nvme_bytes} bytes cannot hold one block "
                f"({per_block} bytes for this model)"
            )
        self.nvme = layout
        if layout.manifest.exists():
            try:
                _, workspaces = read_manifest(layout.manifest)
                for ws in workspaces:
                    self.sessions.add(ws)
            except ManifestError as e:
                logger.warning("sekv nvme: ignoring the manifest (%s); blocks stay restorable", e)
        return num_records, layout.scan(rank=0)

    def _tokens_of(self, req_id: str) -> Any:
        """A request's known tokens in virtual order (a view job's full history)."""
        request = self._requests.get(req_id)
        if request is None:
            return ()
        virtual = self.views.tokens_of(request)
        return virtual if virtual is not None else request.all_token_ids

    # ---------------------------------------------------------- vLLM calls

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._requests[request.request_id] = request
        if request.request_id in self.views.jobs:
            return self.views.next_pass(request), False
        ext = self.planner.match(
            request.request_id,
            request.prompt_token_ids or (),
            compat.request_cache_salt(request),
            compat.request_params(request).session_id,
            num_computed_tokens,
        )
        if ext and request.request_id not in self._matches_offered and head_start.has_worker(self._engine_id):
            # A worker in this process starts the restore's copies now, before
            # vLLM allocates the blocks. Once per request: one vLLM cannot
            # schedule yet is matched again every step, and its copies would
            # be dropped every time.
            self._matches_offered.add(request.request_id)
            slots = self.planner.match_slots(request.request_id, ext)
            if slots is not None:
                head_start.offer_match(self._engine_id, slots)
        return ext, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.planner.set_paged_blocks(request.request_id, blocks.get_block_ids()[0], replace=True)
        self.planner.accept_restore(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> SekvMetadata:
        for new in scheduler_output.scheduled_new_reqs:
            self.planner.set_paged_blocks(new.req_id, compat.new_request_block_ids(new), True)
            self.planner.note_first_schedule(new.req_id, new.num_computed_tokens)
        for req_id, block_ids, replace in compat.cached_request_updates(
            scheduler_output.scheduled_cached_reqs
        ):
            if block_ids is not None:
                self.planner.set_paged_blocks(req_id, block_ids, replace)
        scheduled = {
            req_id: (self._requests[req_id].num_computed_tokens, n)
            for req_id, n in scheduler_output.num_scheduled_tokens.items()
            if req_id in self._requests
        }
        plan = self.planner.plan_step(scheduled, self._tokens_of)
        plan.batch_tokens = scheduler_output.total_num_scheduled_tokens
        head_start.offer(self._engine_id, plan)  # a worker in this process starts its restore now
        return SekvMetadata(plan)

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, SekvWorkerMeta):
            return
        meta = meta.settled()
        for req_id, seconds in meta.restore_seconds.items():
            st = self.planner.requests.get(req_id)
            if st is not None:
                st.restore_seconds += seconds
            params = self._open_params.get(req_id)
            if params is not None:  # finished this step: its last restore adds to what it reported
                params["restore_ms"] = round(params["restore_ms"] + 1000.0 * seconds, 3)
        for req_id, rows in meta.scores.items():
            self.views.set_scores(req_id, rows)
        if meta.surprisal is not None:
            self.planner.note_surprisal(*meta.surprisal)
        self.planner.nvme_done(meta.nvme_completions)
        self.planner.confirm(meta.confirmed_step, meta.failed_slots, self._tokens_of)
        self._open_params.clear()

    def view_pass_done(self, request: Any) -> None:
        """The scheduler hook took `request` out after a non-sampling view pass."""
        self.views.pass_done(request, self._tokens_of)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        req_id = request.request_id
        progress = self.views.virtual_progress(request)
        tokens, computed = progress or (request.all_token_ids, compat.finished_tokens(request))
        view_info = self.views.finish(request)
        self._requests.pop(req_id, None)
        self._matches_offered.discard(req_id)
        st = self.planner.finish(req_id, tokens, computed)
        if st is None:
            return False, None
        restored, cached = st.restored_tokens, max(st.cached_tokens, 0)
        by_tier = {Tier.HOST.value: restored - st.nvme_read_tokens}
        if self.nvme is not None:
            by_tier[Tier.NVME.value] = st.nvme_read_tokens
        params: dict[str, Any] = {
            "restored_tokens": by_tier,  # by the tier each block came from
            "prefilled_tokens": st.num_prompt_tokens - cached,
            "vllm_cached_tokens": cached - restored,
            "restore_ms": round(1000.0 * st.restore_seconds, 3) if restored else 0.0,
            "workspace_blocks": self.catalog.num_committed,
        }
        if view_info is not None:
            params["prefilled_tokens"] = view_info.pop("prefilled_tokens")
            params["view"] = view_info
        if restored:
            # vLLM frees a request before it hands the scheduler side its
            # step's worker report: that step's restore time (a view's final
            # pass, or a one-step request's only restore) comes later this step.
            self._open_params[req_id] = params
        self._write_manifest()
        return False, {"sekv": params}

    # ------------------------------------------------------------ upkeep

    def _write_manifest(self) -> None:
        if self.nvme is None or not self.sessions.dirty:
            return
        try:
            write_manifest(self.nvme.manifest, self.sessions, self._fingerprint)
            self.sessions.dirty = False
        except OSError as e:
            logger.warning("sekv nvme: could not write the manifest: %s", e)

    def shutdown(self) -> None:
        self._write_manifest()
        if self._lock is not None:
            self._lock.release()
            self._lock = None
