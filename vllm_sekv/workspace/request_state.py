"""One request's state in the planner, and what follows from it alone: the
paged slots of its positions, and where a restore of view positions reads.

Plain data plus pure helpers; the planner owns and mutates it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Container, Sequence

import numpy as np

from vllm_sekv.workspace.catalog import BlockRecord
from vllm_sekv.workspace.coarse_plan import CoarsePlan
from vllm_sekv.workspace.step_plan import CoarseSummaries, LowRankBlock, RestoreOp, ScoreOp, SurprisalOp
from vllm_sekv.workspace.view_passes import ViewPass


def prompt_key(prompt: Sequence[int], tenant: str, session_id: str | None, block_tokens: int) -> tuple:
    """What tells one request's prompt from another's under the same id (cheap:
    its tenant, session, length and first and last block)."""
    return (tenant, session_id, len(prompt), tuple(prompt[:block_tokens]), tuple(prompt[-block_tokens:]))


@dataclass
class RequestState:
    req_id: str
    tenant: str  # tenant key (`workspace.tenants`): the root of its block hashes
    session_id: str | None
    num_prompt_tokens: int
    key: tuple = ()  # `prompt_key` of the prompt it was created for
    hashes: list[bytes] = field(default_factory=list)  # of full blocks known so far
    paged_block_ids: list[int] = field(default_factory=list)
    matched: list[BlockRecord] = field(default_factory=list)  # restorable blocks from ...
    match_first_block: int = 0  # ... this block index on
    waiting_pins: list[BlockRecord] = field(default_factory=list)  # held while NVMe reads run
    promoted: set[bytes] = field(default_factory=set)  # blocks read back from NVMe for it
    remote_promoted: set[bytes] = field(default_factory=set)  # blocks read from the remote tier for it
    match_end_tokens: int = 0  # tokens the match reaches (local hit + workspace)
    pending_restore: RestoreOp | None = None
    restore_pins: dict[int, list[BlockRecord]] = field(default_factory=dict)  # step -> pinned
    captures: dict[int, BlockRecord] = field(default_factory=dict)  # block index -> reserved
    skip_blocks: set[int] = field(default_factory=set)  # not ours to capture
    capture_broken: bool = False  # the host tier had no slot to give up: stop reserving
    # Blocks it computed from then on: not kept (the forward writes a block's
    # KV once, and a capture reads it then or never).
    unkept: set[int] = field(default_factory=set)
    finished: bool = False
    # Blocks pinned until the request ends: the blocks it committed itself
    # (never victims of its own later captures while it runs), and for
    # execution views its matched history (re-pinned at every match).
    held_pins: list[BlockRecord] = field(default_factory=list)
    # Execution views: the current pass.
    view: ViewPass | None = None
    view_virtual: np.ndarray | None = None  # virtual position of each of the view's history tokens
    # SeKV coarse attention of the current view: on while `coarse`; the
    # summaries go to the worker with the view's first step.
    coarse: bool = False
    coarse_pending: CoarseSummaries | None = None
    # SeKV lowrank restores of the current view: virtual block -> rank and pieces.
    view_lowrank: dict[int, LowRankBlock] = field(default_factory=dict)
    # Figures reported back in the response's kv_transfer_params.
    cached_tokens: int = -1  # prompt tokens not computed: vLLM's hit + restored
    restored_tokens: int = 0
    nvme_read_tokens: int = 0  # of those, tokens read back from NVMe for this request
    remote_read_tokens: int = 0  # of those, tokens read from the remote tier
    restore_seconds: float = 0.0
    unkept_blocks: int = 0  # full blocks it computed that the workspace could not keep
    resident_blocks: int = 0  # of restored_tokens' blocks, those copied from the device's resident pool

    def paged_slots(self, paged_block_size: int, positions: np.ndarray) -> np.ndarray:
        """vLLM's paged slot of each of the request's `positions`. Converts
        only the block ids they fall in (a decode step: one of thousands)."""
        pbs = paged_block_size
        blocks = positions // pbs
        if not len(blocks):
            return blocks
        first, last = int(blocks.min()), int(blocks.max())
        ids = np.asarray(self.paged_block_ids[first:last + 1], dtype=np.int64)
        return ids[blocks - first] * pbs + positions % pbs

    def restored_blocks(self, blocks: np.ndarray) -> list[BlockRecord]:
        """The matched blocks a restore reads (`blocks`: each row's index in
        `matched`); notes how many of its rows were read back from NVMe and
        from the remote tier for it."""
        rows_of = np.bincount(blocks, minlength=len(self.matched))
        used_blocks = np.flatnonzero(rows_of).tolist()
        used = [self.matched[b] for b in used_blocks]
        self.nvme_read_tokens = sum(int(rows_of[b]) for b, rec in zip(used_blocks, used)
                                    if rec.block_hash in self.promoted) if self.promoted else 0
        self.remote_read_tokens = sum(int(rows_of[b]) for b, rec in zip(used_blocks, used)
                                      if rec.block_hash in self.remote_promoted) if self.remote_promoted else 0
        return used

    def settle_unkept(self, kept: Container[bytes]) -> None:
        """Count in `unkept_blocks` the full blocks it could not keep that
        `kept` (the catalog) lacks, kept by no other request either; its
        capture may start over (a new view pass)."""
        self.unkept_blocks += sum(1 for b in self.unkept if b < len(self.hashes) and self.hashes[b] not in kept)
        self.unkept.clear()
        self.capture_broken = False

    def view_sources(self, positions: np.ndarray, block_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Host rows, re-RoPE deltas (view - virtual) and the index in
        `self.matched` of the block of each row, restoring view `positions`."""
        bt = block_tokens
        if self.view is None:  # same positions: block i of the match restores block first + i
            virtual = positions
            deltas = np.zeros(len(positions), dtype=np.int64)
        else:  # self.matched starts at block 0: view position -> virtual position
            virtual = self.view_virtual[positions]
            deltas = positions - virtual
        index = virtual // bt
        if self.view is None:
            index -= self.match_first_block
        if len(index) and (index.min() < 0 or index.max() >= len(self.matched)):
            raise ValueError(f"request {self.req_id}: restore beyond the matched blocks")
        rows = np.array([rec.host_slot for rec in self.matched], dtype=np.int64).take(index)
        rows *= bt  # in place: at 64K rows each temporary array costs more than the arithmetic
        rows += virtual % bt
        return rows, deltas, index

    def coarse_summaries(self, plan: CoarsePlan, view: ViewPass, block_tokens: int) -> CoarseSummaries:
        """The summaries' source rows for the worker, from a view's coarse plan."""
        bt = block_tokens
        slots = np.array([rec.host_slot for rec in self.matched], dtype=np.int64)
        if len(plan.positions) and plan.positions[-1] >= len(slots) * bt:
            raise ValueError(f"request {self.req_id}: summaries of tokens the match does not hold")
        rows = slots[plan.positions // bt] * bt + plan.positions % bt
        return CoarseSummaries(rows, plan.positions, plan.summary_of, plan.surprisal,
                               plan.summary_positions, plan.num_tokens, view.history_tokens)

    def score_op(self, first: int, count: int, block_tokens: int, paged_block_size: int,
                 probe_query_tokens: int) -> ScoreOp | None:
        """The probe's queries in [first, first + count): the last
        `probe_query_tokens` of its tail (0: all of it) score its candidate blocks."""
        view = self.view
        tail_end = view.history_tokens + view.tail_tokens
        lo = view.history_tokens
        if probe_query_tokens:
            lo = max(lo, tail_end - probe_query_tokens)
        lo, hi = max(lo, first), min(tail_end, first + count)
        last = first + count >= view.num_tokens - 1
        if hi <= lo and not last:
            return None
        positions = np.arange(lo, max(hi, lo), dtype=np.int64)
        bt = block_tokens
        return ScoreOp(
            req_id=self.req_id,
            query_paged_slots=self.paged_slots(paged_block_size, positions),
            query_positions=positions,
            candidate_slots=np.array(
                [self.matched[b].host_slot for b in view.candidates], dtype=np.int64
            ),
            candidate_starts=np.array(view.candidates, dtype=np.int64) * bt,
            last=last,
            query_virtual_offset=view.tail_offset,
            rerank_extra=np.asarray(view.rerank_extra, dtype=np.int64),
        )

    def surprisal_op(self, first: int, count: int, offset: int, captured: np.ndarray, host_rows: np.ndarray,
                     paged_block_size: int) -> SurprisalOp:
        """All `count` tokens the request computes from `first` (its own
        positions): each one's predecessor predicts it; the captured ones keep
        the result at their host rows."""
        rows = np.full(count, -1, dtype=np.int64)
        rows[captured - offset - first] = host_rows
        return SurprisalOp(self.req_id, self.paged_slots(paged_block_size, np.arange(first, first + count, dtype=np.int64)),
                           rows, first + offset)
