"""Scheduler-side connector: translates vLLM's scheduler calls for the planner.

Runs in the engine-core process on the scheduler thread. Owns the catalog,
the sessions and the planner (bookkeeping only; the bytes are in the workers),
and, with an NVMe tier, the folder's lock and manifest. Every call is blocking
and cheap. When a request of a named session finishes, its row of the
manifest is written by the manifest's own thread (`ManifestWriter`), so a
server killed at any point has listed every session it served.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from vllm_sekv import compat, model_identity, request_params
from vllm_sekv.config import SekvConfig
from vllm_sekv.protocol import head_start
from vllm_sekv.protocol.metadata import SekvMetadata, SekvWorkerMeta, block_bytes_per_rank, host_slots, nvme_layout, \
    record_layout
from vllm_sekv.scheduler_side.remote_lookup import RemoteTier
from vllm_sekv.scheduler_side.view_coordinator import ViewCoordinator
from vllm_sekv.store import Tier, make_policy
from vllm_sekv.store.nvme import DirLock, NvmeLayout
from vllm_sekv.store.records import record_bytes
from vllm_sekv.workspace.catalog import BlockCatalog
from vllm_sekv.workspace.manifest import ManifestWriter, open_or_set_aside
from vllm_sekv.workspace.vocabulary import Vocabulary
from vllm_sekv.workspace.planner import WorkspacePlanner
from vllm_sekv.workspace.sessions import SessionTable
from vllm_sekv.workspace.tenants import TenantKeys, resolve_secret

logger = logging.getLogger("vllm_sekv")


def _share(num_blocks: int, percent: int) -> int:
    """Most blocks one tenant may hold on a tier of `num_blocks` (0: no limit)."""
    return max(1, num_blocks * percent // 100) if percent else 0


class SekvSchedulerSide:
    def __init__(self, config: SekvConfig, vllm_config: Any, kv_cache_config: Any = None) -> None:
        num_slots, block_bytes = host_slots(config, vllm_config)
        world_size = model_identity.kv_geometry(vllm_config).world_size
        self.sessions = SessionTable(config.max_sessions)
        self.nvme: NvmeLayout | None = None
        self._lock: DirLock | None = None
        self._manifest: ManifestWriter | None = None
        self._fingerprint = model_identity.model_fingerprint(vllm_config, config.block_tokens,
                                                                config.workspace_codec)
        self._engine_id = head_start.engine_id(vllm_config)
        num_records, found = 0, []
        try:
            if config.nvme_dir:
                num_records, found = self._open_nvme(config, vllm_config, world_size)
            self.tenants = TenantKeys(resolve_secret(config.hash_secret, config.nvme_dir or None))
        except OSError as e:  # a read-only or unreachable folder, a secret that cannot be read
            raise ValueError(f"sekv config 'nvme_dir': cannot use {config.nvme_dir}: {e}") from e
        self.catalog = BlockCatalog(
            num_slots,
            make_policy(config.policy, num_slots, config.protected_percent),
            num_records,
            make_policy(config.policy, num_records, config.protected_percent),
            host_share=_share(num_slots, config.tenant_host_percent),
            nvme_share=_share(num_records, config.tenant_nvme_percent),
        )
        for info in found:
            self.catalog.add_stored(info.block_hash, info.start_token, info.tenant.hex())
        self.remote = RemoteTier(config, self.tenants) if config.remote_url else None
        self.planner = WorkspacePlanner(
            self.catalog,
            self.sessions,
            block_tokens=config.block_tokens,
            paged_block_size=compat.kv_cache_block_size(vllm_config),
            min_restore_tokens=config.min_restore_tokens,
            world_size=world_size,
            probe_query_tokens=config.probe_query_tokens,
            record_surprisal=config.surprisal == "on",
            remote_lookup=self.remote.lookup if self.remote is not None else None,
        )
        self.views = ViewCoordinator(
            config,
            self.planner,
            self.tenants.of,
            window_tokens=compat.native_window_tokens(vllm_config),
            capacity_tokens=compat.kv_capacity_tokens(kv_cache_config, vllm_config),
            vocabulary=lambda: Vocabulary.of(compat.load_tokenizer(vllm_config)),
        )
        self._requests: dict[str, Any] = {}
        self._matches_offered: set[str] = set()  # requests whose match went to `head_start.offer_match`
        # kv_transfer_params already handed to vLLM for finished requests,
        # completed when the worker reports their last step (see
        # `update_connector_output`).
        self._open_params: dict[str, dict[str, Any]] = {}
        self._unkept_warned_at = float("-inf")
        logger.info(
            "sekv: host tier of %d blocks x %d tokens (%.1f MiB per block)%s",
            num_slots, config.block_tokens, block_bytes / 2**20,
            f", NVMe tier of {num_records} blocks in {self.nvme.root} "
            f"({self.catalog.num_nvme_used} found)" if self.nvme else "",
        )

    def _open_nvme(self, config: SekvConfig, vllm_config: Any, world_size: int) -> tuple[int, list]:
        """Lock the model's folder, clear what an earlier run left in tmp/,
        load the manifest and scan the records. Raises OSError (the caller
        names `nvme_dir`) or NvmeDirInUse."""
        layout = nvme_layout(config, vllm_config)
        layout.create()
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
        manifest = open_or_set_aside(layout.manifest, self._fingerprint, config.nvme_sync == "on")
        for ws in manifest.load():
            self.sessions.add(ws)
        for ws in self.sessions.take_evicted():  # more than max_sessions on disk: the oldest go
            manifest.delete([(ws.tenant, ws.session_id)])
        self._manifest = ManifestWriter(manifest)
        return num_records, layout.scan(record_layout(config, vllm_config, rank=0))

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
            self.tenants.of(compat.request_cache_salt(request)),
            request_params.of_request(request).session_id,
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
        for req_id in meta.restore_seconds.keys() | meta.resident_blocks.keys():
            seconds, placed = meta.restore_seconds.get(req_id, 0.0), meta.resident_blocks.get(req_id, 0)
            st = self.planner.requests.get(req_id)
            if st is not None:
                st.restore_seconds += seconds
                st.resident_blocks += placed
            params = self._open_params.get(req_id)
            if params is not None:  # finished this step: its last restore adds to what it reported
                params["restore_ms"] = round(params["restore_ms"] + 1000.0 * seconds, 3)
                params["resident_blocks"] += placed
        for req_id, rows in meta.scores.items():
            self.views.set_scores(req_id, rows)
        if meta.surprisal is not None:
            self.planner.note_surprisal(*meta.surprisal)
        self.planner.io_done(meta.io_completions)
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
        by_tier = {Tier.HOST.value: restored - st.nvme_read_tokens - st.remote_read_tokens}
        if self.nvme is not None:
            by_tier[Tier.NVME.value] = st.nvme_read_tokens
        if self.remote is not None:
            by_tier[Tier.REMOTE.value] = st.remote_read_tokens
        params: dict[str, Any] = {
            "restored_tokens": by_tier,  # by the tier each block came from
            "prefilled_tokens": st.num_prompt_tokens - cached,
            "vllm_cached_tokens": cached - restored,
            "restore_ms": round(1000.0 * st.restore_seconds, 3) if restored else 0.0,
            "resident_blocks": st.resident_blocks,  # restored from the device's resident pool, not moved
            "unkept_tokens": st.unkept_blocks * self.planner.block_tokens,  # full blocks the host tier had no room for
            "workspace_blocks": self.catalog.tenant_blocks(st.tenant),  # this tenant's only
        }
        if view_info is not None:
            params["prefilled_tokens"] = view_info.pop("prefilled_tokens")
            params["view"] = view_info
        if restored:
            # vLLM frees a request before it hands the scheduler side its
            # step's worker report: that step's restore time (a view's final
            # pass, or a one-step request's only restore) comes later this step.
            self._open_params[req_id] = params
        if st.unkept_blocks:
            self._warn_unkept(req_id, st.unkept_blocks)
        self._note_session(st)
        return False, {"sekv": params}

    # ------------------------------------------------------------ upkeep

    def _warn_unkept(self, req_id: str, blocks: int) -> None:
        """At most one warning a minute: a busy server would repeat it every request."""
        now = time.monotonic()
        if now - self._unkept_warned_at >= 60.0:
            self._unkept_warned_at = now
            logger.warning("sekv: request %s: %d computed blocks were not kept: every host slot was held by a "
                           "restore, a running request or an NVMe write (a larger host_bytes keeps them)",
                           req_id, blocks)

    def _note_session(self, st: Any) -> None:
        """Hand a finished request's session (and any the table let go) to
        the manifest's and the remote tier's writer threads; never waits."""
        evicted = self.sessions.take_evicted()
        ws = self.sessions.get(st.tenant, st.session_id) if st.session_id is not None else None
        if self._manifest is not None:
            for gone in evicted:
                self._manifest.delete((gone.tenant, gone.session_id))
            if ws is not None:
                self._manifest.put(ws)
        if self.remote is not None and ws is not None:
            self.remote.put_session(ws)

    def shutdown(self) -> None:
        if self.remote is not None:
            self.remote.close()
            self.remote = None
        if self._manifest is not None:
            self._manifest.close()
            self._manifest = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None
