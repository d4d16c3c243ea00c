"""The scheduler-side brain of restore and capture, free of vLLM types.

Per request it
  * matches the prompt against the catalog (`match`): vLLM's own prefix cache
    covers the first `local_tokens`; the workspace continues from there as far
    as committed blocks reach, never past the prompt's last token (vLLM must
    compute at least one token to sample from);
  * turns an accepted match into a restore (`accept_restore`), pinning the
    blocks until the worker confirms the step that read them;
  * plans, per engine step, which freshly computed tokens the worker captures
    into which host rows (`plan_step`), reserving a slot per new block;
  * commits a block once all its tokens were captured in confirmed steps and
    its token ids are known (`confirm`), and then asks the worker to index it
    and, with an NVMe tier, to write it behind; a live request's own blocks
    stay pinned until it ends, never victims of its later captures;
  * when a match reaches blocks held only on NVMe, has the worker read them
    back into host slots and answers "not yet" (None) until the checked reads
    are confirmed; a failed read ends the match there (a miss).

A request served from an execution view (`workspace.view_passes`) runs as passes:
`begin_view_pass` maps each view block to the workspace block it restores,
re-RoPE'd by the difference of the two positions; the pass's own tokens are
captured at their *virtual* positions (their place in the full history), and
a probe pass asks the worker to score candidate blocks with its queries.

Blocks already committed (another request computed them) are not captured
twice. A capture the worker could not complete releases the block's slot: it
never becomes matchable, so wrong KV is never restored.

Single-threaded, on the engine-core scheduler thread. Blocking, cheap: O(tokens
scheduled) per step.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from vllm_sekv.workspace.catalog import BlockCatalog, BlockRecord, NvmeState
from vllm_sekv.workspace.hashing import PrefixHashMemo, extend_block_hashes
from vllm_sekv.workspace.coarse_plan import CoarsePlan
from vllm_sekv.workspace.step_plan import CoarseOp, LowRankBlock, RestoreOp, StepPlan
from vllm_sekv.workspace.request_state import RequestState, prompt_key
from vllm_sekv.workspace.sessions import SessionTable
from vllm_sekv.workspace.tier_queues import TierQueues
from vllm_sekv.workspace.view_passes import PassKind, ViewPass

TokenSource = Callable[[str], Sequence[int]]
# (hashes in order, tenant, session id) -> how many leading ones the remote tier holds
RemoteLookup = Callable[[list, str, "str | None"], int]


class WorkspacePlanner:
    def __init__(
        self,
        catalog: BlockCatalog,
        sessions: SessionTable,
        block_tokens: int,
        paged_block_size: int,
        min_restore_tokens: int = 0,
        world_size: int = 1,
        probe_query_tokens: int = 0,
        record_surprisal: bool = False,
        remote_lookup: RemoteLookup | None = None,
    ) -> None:
        self.probe_query_tokens = probe_query_tokens
        # The remote tier (a store several servers share): how many of some
        # hashes it holds, in order; None without one. Blocks whose remote
        # read failed are not offered again for a while.
        self.remote_lookup = remote_lookup
        # SeKV: per host row, the surprisal of the token it holds (NaN: unknown),
        # reported by the worker that computed it; None when not recorded.
        self.surprisal = (np.full((catalog.num_host_slots, block_tokens), np.nan, dtype=np.float32)
                          if record_surprisal else None)
        self.catalog = catalog
        self.sessions = sessions
        self.block_tokens = block_tokens
        self.paged_block_size = paged_block_size
        self.min_restore_tokens = min_restore_tokens
        self.requests: dict[str, RequestState] = {}  # live requests by id
        # Finished requests whose captures or restores the worker has yet to confirm.
        self._retired: list[RequestState] = []
        # A session's next prompt repeats its last one: reuse those block hashes.
        self._prompt_hashes = PrefixHashMemo(block_tokens)
        self._next_step = 0
        self._confirmed_step = -1
        self._index_queue: list[tuple[int, int]] = []
        self._coarse_finished: list[str] = []
        self.world_size = world_size
        self.transfers = TierQueues(catalog, world_size)

    # ------------------------------------------------------------- matching

    def match(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        tenant: str,
        session_id: str | None,
        local_tokens: int,
    ) -> int | None:
        """Tokens beyond `local_tokens` (vLLM's own hit) the workspace can
        restore, or None while blocks of the match are being read from NVMe."""
        st = self._state(req_id, prompt_token_ids, tenant, session_id)
        self._hash_prompt(st, prompt_token_ids)
        bt = self.block_tokens
        first = local_tokens // bt
        self.catalog.unpin(st.waiting_pins)
        st.waiting_pins = []
        held = self._held(st, first)
        usable, reading = self._promote(held, st)
        if reading:
            self.catalog.pin(held[:usable])
            st.waiting_pins = held[:usable]
            return None
        st.matched, st.match_first_block = held[:usable], first
        end = min((first + usable) * bt, len(prompt_token_ids) - 1)
        st.match_end_tokens = max(end, local_tokens)
        ext = st.match_end_tokens - local_tokens
        return ext if ext >= max(self.min_restore_tokens, 1) else 0

    def _held(self, st: RequestState, first: int) -> list[BlockRecord]:
        """The catalog's records of the prompt's blocks from `first` on, as
        far as they reach; then those the remote tier holds after them."""
        held = self.catalog.match_prefix(st.hashes[first:])
        start = first + len(held)
        if self.remote_lookup is None or start >= len(st.hashes):
            return held
        wanted = self.transfers.offered_remote(st.hashes[start:])
        for b in range(start, start + self.remote_lookup(wanted, st.tenant, st.session_id)):
            rec = self.catalog.add_remote(st.hashes[b], b * self.block_tokens, st.tenant)
            if rec is None:
                break
            held.append(rec)
        return held

    def _promote(self, held: list[BlockRecord], st: RequestState) -> tuple[int, bool]:
        """(leading blocks of `held` on or coming to the host, whether NVMe or remote reads run for some)."""
        if self.catalog.all_on_host(held):  # nothing to promote (the common case, without a Python loop)
            return len(held), self.catalog.any_loading(held)
        usable, reading, pinned = 0, False, False
        try:
            for rec in held:
                if rec.host_slot is None:
                    if not pinned:  # promotions must not evict the blocks before them
                        self.catalog.pin(held)
                        pinned = True
                    if not self.catalog.promote(rec):
                        break
                    self.transfers.queue_read(rec)
                    (st.remote_promoted if rec.remote else st.promoted).add(rec.block_hash)
                reading = reading or rec.loading
                usable += 1
        finally:
            self.catalog.unpin(held if pinned else ())
            self.catalog.drop_unpromoted(held[usable:])
        return usable, reading

    def match_slots(self, req_id: str, num_external_tokens: int) -> np.ndarray | None:
        """The host slots, in order, that the restore of the match's last
        `num_external_tokens` tokens reads once accepted (one per block it
        touches); None for a view pass, or a match not all on the host."""
        st = self.requests[req_id]
        if st.view is not None or num_external_tokens <= 0:
            return None
        bt = self.block_tokens
        first = (st.match_end_tokens - num_external_tokens) // bt - st.match_first_block
        end = -(-st.match_end_tokens // bt) - st.match_first_block
        if first < 0 or end > len(st.matched):
            return None
        slots = [rec.host_slot for rec in st.matched[first:end]]
        return None if None in slots else np.array(slots, dtype=np.int64)

    def accept_restore(self, req_id: str, num_external_tokens: int) -> None:
        """vLLM takes `num_external_tokens` from us, ending at the match end."""
        st = self.requests[req_id]
        if num_external_tokens <= 0:
            return
        bt = self.block_tokens
        positions = np.arange(st.match_end_tokens - num_external_tokens, st.match_end_tokens, dtype=np.int64)
        host_rows, deltas, blocks = st.view_sources(positions, self.block_tokens)
        st.pending_restore = RestoreOp(
            req_id, np.zeros(0, np.int64), host_rows, deltas if deltas.any() else None,
            st.view.kind.value if st.view is not None else "", int(positions[0]),
        )
        if st.view is not None and st.view_lowrank:
            held = {int(p) // bt for p in st.view_virtual[positions]}
            st.pending_restore.lowrank = {
                st.matched[b].host_slot: block for b, block in st.view_lowrank.items() if b in held}
        st.restored_tokens = num_external_tokens  # like resident_blocks: this restore's (a view's last pass)
        st.resident_blocks = 0
        used = st.restored_blocks(blocks)
        self.catalog.pin(used)
        self.catalog.touch(used)
        st.restore_pins[-1] = used  # re-keyed to the step that carries the restore

    # ------------------------------------------------------ execution views

    def match_history(
        self, req_id: str, prompt_token_ids: Sequence[int], tenant: str, session_id: str | None
    ) -> int | None:
        """Leading blocks of the prompt that the workspace holds, all pinned for
        the request's views; None while blocks of them are read from NVMe."""
        st = self._state(req_id, prompt_token_ids, tenant, session_id)
        self._hash_prompt(st, prompt_token_ids)
        pinned = st.waiting_pins + st.held_pins  # kept while promotions run, then re-pinned as matched
        st.waiting_pins, st.held_pins = [], []
        held = self._held(st, 0)
        usable, reading = self._promote(held, st)
        self.catalog.repin(pinned, held[:usable])
        if reading:
            st.waiting_pins = held[:usable]
            return None
        st.matched, st.match_first_block = held[:usable], 0
        st.held_pins = list(st.matched)
        return usable

    def _state(self, req_id: str, prompt_token_ids: Sequence[int], tenant: str,
               session_id: str | None) -> RequestState:
        """The live request's state, or a new one. Request ids are the
        client's to choose (vLLM can be told not to randomize them): a state
        is only ever reused for the same live request, never for a later one
        that repeats the id, for another tenant or with another prompt."""
        key = prompt_key(prompt_token_ids, tenant, session_id, self.block_tokens)
        st = self.requests.get(req_id)
        if st is not None and st.key == key and not st.finished:
            return st
        if st is not None:
            self._retire(st)
        st = self.requests[req_id] = RequestState(req_id, tenant, session_id, len(prompt_token_ids), key=key)
        return st

    def _retire(self, st: RequestState) -> None:
        """Take `st` out of the live requests; captures it still waits for
        complete (or are released) as the worker confirms them."""
        if self.requests.get(st.req_id) is st:
            del self.requests[st.req_id]
        if not st.finished:  # a live request's id taken over: its work is void
            self._release_captures(st)
            self.catalog.unpin(st.waiting_pins + st.held_pins)
            st.waiting_pins, st.held_pins = [], []
            st.finished = True
        if st.captures or st.restore_pins:
            self._retired.append(st)

    def _hash_prompt(self, st: RequestState, prompt_token_ids: Sequence[int]) -> None:
        """`st.hashes` cover every full block of the prompt (hashed once per
        request, reusing what the session's last prompt shares with it)."""
        if not st.hashes:
            st.hashes = self._prompt_hashes.hashes(prompt_token_ids, st.tenant, st.session_id)
        else:
            extend_block_hashes(st.hashes, prompt_token_ids, self.block_tokens, st.tenant)

    def history_surprisal(self, req_id: str) -> np.ndarray | None:
        """Surprisal of each token of `req_id`'s matched history, in virtual
        order (NaN: unknown); None when surprisal is not recorded."""
        st = self.requests.get(req_id)
        if self.surprisal is None or st is None:
            return None
        slots = np.array([rec.host_slot for rec in st.matched], dtype=np.int64)
        return self.surprisal[slots].reshape(-1)

    def begin_view_pass(self, req_id: str, view: ViewPass, coarse: CoarsePlan | None = None,
                        lowrank: dict[int, LowRankBlock] | None = None) -> int:
        """Start a pass of `req_id`'s views; returns the tokens vLLM restores
        (the pass's history part). `coarse`: the SeKV summaries that stand in
        for the history the view leaves out; `lowrank`: history blocks (virtual
        block index) restored from low-rank factors, with their rank and pieces.
        The sampling pass uses the whole history it matched (its probes scored
        all of it): recency is a session's, so an active session's unselected
        history is never evicted ahead of an idle session's blocks."""
        st = self.requests[req_id]
        positions = np.asarray(view.history_positions(), dtype=np.int64)
        if len(positions) and positions.max() >= len(st.matched) * self.block_tokens:
            raise ValueError(f"request {req_id}: the view holds blocks the match does not")
        if view.samples:
            self.catalog.touch(st.matched)
        self._release_captures(st)
        if st.coarse:
            self._coarse_finished.append(req_id)
        st.coarse = coarse is not None and coarse.num_summaries > 0
        st.coarse_pending = st.coarse_summaries(coarse, view, self.block_tokens) if st.coarse else None
        st.view_lowrank = dict(lowrank or {})
        st.view, st.view_virtual = view, positions
        st.settle_unkept(self.catalog)
        st.paged_block_ids, st.skip_blocks = [], set()
        st.pending_restore, st.cached_tokens = None, -1
        st.match_end_tokens = view.history_tokens
        return view.history_tokens

    # ------------------------------------------------------- per-step planning

    def note_first_schedule(self, req_id: str, num_computed_tokens: int) -> None:
        st = self.requests.get(req_id)
        if st is not None and st.cached_tokens < 0:
            st.cached_tokens = num_computed_tokens

    def set_paged_blocks(self, req_id: str, block_ids: list[int], replace: bool) -> None:
        st = self.requests.get(req_id)
        if st is None:
            return
        if replace:
            st.paged_block_ids = list(block_ids)
        else:
            st.paged_block_ids.extend(block_ids)

    def plan_step(
        self, scheduled: dict[str, tuple[int, int]], tokens_of: TokenSource
    ) -> StepPlan:
        """Plan one engine step. `scheduled[req_id] = (first_token, num_tokens)`
        computed in this step, in the request's own (view) positions;
        `tokens_of(req_id)` gives the request's known tokens in virtual order."""
        self.commit_ready(tokens_of)
        step = StepPlan(step_id=self._next_step)
        self._next_step += 1
        src: list[np.ndarray] = []
        dst: list[np.ndarray] = []
        deltas: list[np.ndarray] = []
        for req_id, (first, count) in scheduled.items():
            st = self.requests.get(req_id)
            if st is None or count <= 0:
                continue
            if st.pending_restore is not None:
                op = st.pending_restore
                start = st.match_end_tokens - len(op.host_rows)
                op.paged_slots = st.paged_slots(self.paged_block_size,
                                                np.arange(start, st.match_end_tokens, dtype=np.int64))
                step.restores.append(op)
                st.restore_pins[step.step_id] = st.restore_pins.pop(-1, [])
                st.pending_restore = None
            if st.coarse:
                positions = np.arange(first, first + count, dtype=np.int64)
                step.coarse.append(CoarseOp(req_id, st.paged_slots(self.paged_block_size, positions), positions,
                                            st.coarse_pending))
                st.coarse_pending = None
            if st.view is not None and st.view.kind is PassKind.PROBE:
                score = st.score_op(first, count, self.block_tokens, self.paged_block_size, self.probe_query_tokens)
                if score is not None:
                    step.scores.append(score)
                continue  # a probe's tokens see a truncated history: never saved
            offset = st.view.tail_offset if st.view is not None else 0
            # A view's history (restored or recomputed) is in the workspace already: never saved again.
            skip = max(0, st.view.tail_view_start - first) if st.view is not None else 0
            rows = self._plan_capture(st, first + skip + offset, count - skip, step.step_id, tokens_of) \
                if count > skip else None
            if rows is not None:
                positions, host_rows = rows
                src.append(st.paged_slots(self.paged_block_size, positions - offset))
                dst.append(host_rows)
                deltas.append(np.full(len(positions), offset, dtype=np.int64))
                if self.surprisal is not None:
                    step.surprisal.append(st.surprisal_op(first, count, offset, positions, host_rows,
                                                         self.paged_block_size))
        if src:
            step.capture_paged_slots = np.concatenate(src)
            step.capture_host_rows = np.concatenate(dst)
            step.capture_rope_deltas = np.concatenate(deltas)
        step.coarse_finished, self._coarse_finished = self._coarse_finished, []
        step.index_blocks, self._index_queue = self._index_queue, []
        if self.surprisal is not None:
            step.index_surprisal = {slot: self.surprisal[slot].copy() for slot, _ in step.index_blocks}
        step.nvme_deletes = self.catalog.take_deletes()
        self.transfers.fill(step)
        if self.surprisal is not None:
            step.nvme_write_surprisal = {op.host_slot: self.surprisal[op.host_slot].copy() for op in step.nvme_writes}
        return step

    def note_surprisal(self, host_rows: np.ndarray, values: np.ndarray) -> None:
        """The worker's surprisal of tokens it captured (row = slot * block_tokens + offset)."""
        if self.surprisal is not None and len(host_rows):
            self.surprisal.reshape(-1)[host_rows] = values

    def _plan_capture(
        self, st: RequestState, first: int, count: int, step_id: int, tokens_of: TokenSource
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Host rows for the tokens at (virtual) positions [first, first + count)."""
        bt = self.block_tokens
        positions = np.arange(first, first + count, dtype=np.int64)
        host_rows = np.full(count, -1, dtype=np.int64)
        for b in range(first // bt, (first + count - 1) // bt + 1):
            rec = self._capture_record(st, b, first, tokens_of)
            if rec is None:
                continue
            lo, hi = max(b * bt, first), min((b + 1) * bt, first + count)
            host_rows[lo - first : hi - first] = rec.host_slot * bt + np.arange(lo, hi) % bt
            rec.captured_tokens += hi - lo
            rec.last_capture_step = step_id
        keep = host_rows >= 0
        if not keep.any():
            return None
        return positions[keep], host_rows[keep]

    def _capture_record(
        self, st: RequestState, block: int, first: int, tokens_of: TokenSource
    ) -> BlockRecord | None:
        if block in st.captures:
            return st.captures[block]
        if block in st.skip_blocks:
            return None
        bt = self.block_tokens
        if block * bt < first:
            # Part of this block was not computed in this request (a cache hit):
            # it cannot be captured whole.
            st.skip_blocks.add(block)
            return None
        extend_block_hashes(st.hashes, tokens_of(st.req_id), bt, st.tenant)
        if block < len(st.hashes) and st.hashes[block] in self.catalog:
            st.skip_blocks.add(block)  # someone already holds it
            return None
        rec = None if st.capture_broken else self.catalog.reserve(start_token=block * bt, tenant=st.tenant)
        if rec is None:  # every host slot is held: this block and the request's later ones are not kept
            st.capture_broken = True
            st.skip_blocks.add(block)
            st.unkept.add(block)
            return None
        st.captures[block] = rec
        return rec

    # -------------------------------------------------------- confirmations

    def confirm(self, step_id: int, failed_slots: set[int], tokens_of: TokenSource) -> None:
        """The worker finished `step_id` (and every step before it)."""
        for st in [*self.requests.values(), *self._retired]:
            for done in [s for s in st.restore_pins if 0 <= s <= step_id]:
                self.catalog.unpin(st.restore_pins.pop(done))
            for b, rec in list(st.captures.items()):
                if rec.host_slot in failed_slots:
                    del st.captures[b]
                    st.skip_blocks.add(b)
                    self.catalog.release(rec)
        self._confirmed_step = step_id
        self.commit_ready(tokens_of)

    def commit_ready(self, tokens_of: TokenSource) -> None:
        confirmed = self._confirmed_step
        bt = self.block_tokens
        for st in [*self.requests.values(), *self._retired]:
            for b, rec in sorted(st.captures.items()):
                if rec.captured_tokens < bt or rec.last_capture_step > confirmed:
                    continue
                if b >= len(st.hashes) and not st.finished:
                    extend_block_hashes(st.hashes, tokens_of(st.req_id), bt, st.tenant)
                if b >= len(st.hashes):
                    continue
                del st.captures[b]
                if self.catalog.commit(rec, st.hashes[b]):
                    if not st.finished:  # never a victim of its own later captures (`held_pins`)
                        self.catalog.pin([rec])
                        st.held_pins.append(rec)
                    self._index_queue.append((rec.host_slot, rec.start_token))
                    self.transfers.queue_writes(rec, nvme=rec.nvme is NvmeState.WRITING,
                                                remote=self.remote_lookup is not None)
        self._retired = [st for st in self._retired if st.captures or st.restore_pins]

    def _release_captures(self, st: RequestState, complete_blocks: int | None = None) -> None:
        """Drop captures that cannot complete: all of them, or those of blocks
        at or beyond `complete_blocks` and those not fully captured."""
        bt = self.block_tokens
        for b, rec in list(st.captures.items()):
            if complete_blocks is None or rec.captured_tokens < bt or b >= complete_blocks:
                del st.captures[b]
                self.catalog.release(rec)

    def end_pass(self, req_id: str, tokens_of: TokenSource) -> None:
        """A non-sampling view pass finished (its steps are all confirmed)."""
        st = self.requests[req_id]
        self.commit_ready(tokens_of)
        self._release_captures(st)

    def finish(self, req_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> RequestState | None:
        """The request ended. `token_ids` and `num_computed_tokens` are virtual
        (the full history) for a request served from a view. Blocks still
        waiting for confirmation stay reserved until `confirm`; incomplete ones
        are released now; those the host tier had no slot for count in
        `unkept_blocks`."""
        st = self.requests.get(req_id)
        if st is None:
            return None
        st.finished = True
        if st.coarse:
            st.coarse = False
            self._coarse_finished.append(req_id)
        self.catalog.unpin(st.waiting_pins + st.held_pins)
        st.waiting_pins, st.held_pins = [], []
        bt = self.block_tokens
        extend_block_hashes(st.hashes, token_ids, bt, st.tenant, end=num_computed_tokens)
        self._release_captures(st, complete_blocks=len(st.hashes))
        st.settle_unkept(self.catalog)
        if st.session_id is not None:
            self.sessions.record(st.tenant, st.session_id, st.hashes, num_computed_tokens)
        self._retire(st)
        return st

    def has_pending_writes(self) -> bool:
        """Whether committed blocks still wait to be written to a tier."""
        return self.transfers.has_pending_writes()

    def io_done(self, completions: Sequence[tuple[str, bytes, bool]]) -> None:
        """Worker reports of NVMe and remote transfers: (kind, block hash, ok), one per rank."""
        self.transfers.done(completions)
