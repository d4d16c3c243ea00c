"""What the worker does in one engine step: the plan the scheduler side sends.

Plain data (numpy int64 arrays, lists), picklable, no vLLM types. Slots of
vLLM's paged cache are `block_id * paged_block_size + offset`; host rows are
`host_slot * block_tokens + offset`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

import numpy as np

if TYPE_CHECKING:
    from vllm_sekv.workspace.segments import Segments


def _empty() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class LowRankBlock:
    """How one history block moves under a lossy `restore_codec`: as rank-`rank`
    factors (`rank` >= 1) of each piece's pre-RoPE keys and values, the pieces
    being `[lo, hi)` token offsets that cover the block in order."""

    rank: int
    pieces: tuple[tuple[int, int], ...]


def lowrank_blocks(history_blocks: Iterable[int], block_tokens: int, segments: Segments | None,
                   ranks: dict[int, int]) -> dict[int, LowRankBlock]:
    """Those of a view's `history_blocks` that `ranks` rates, each with its
    rank and its pieces: the surprisal `segments` cut at the block's edges
    (the whole block without surprisal)."""
    bt = block_tokens
    starts = segments.starts.numpy() if segments is not None else np.zeros(0, np.int64)
    out = {}
    for b in history_blocks:
        if b not in ranks:
            continue
        inner = starts[(starts > b * bt) & (starts < (b + 1) * bt)] - b * bt
        edges = [0, *inner.tolist(), bt]
        out[b] = LowRankBlock(ranks[b], tuple(zip(edges[:-1], edges[1:])))
    return out


@dataclass
class RestoreOp:
    """Copy host rows into one request's paged slots, before the forward."""

    req_id: str
    paged_slots: np.ndarray  # [n] destination slots in vLLM's paged cache
    host_rows: np.ndarray  # [n] source rows in the host pool
    # [n] rotate row i's key by this many positions (view - virtual) on the
    # way in; None: every row stays where it was computed.
    rope_deltas: np.ndarray | None = None
    view_pass: str = ""  # the execution view pass it serves ("final", "probe", ...), if any
    first_position: int = 0  # the request's position of row 0 (rows are consecutive positions)
    # SeKV lossy `restore_codec`: host slots whose rows move as low-rank
    # factors instead of exact bytes, each with its rank and pieces. Empty: all exact.
    lowrank: dict[int, LowRankBlock] = field(default_factory=dict)


@dataclass
class ScoreOp:
    """A probe: score candidate blocks with the queries of some of this
    step's tokens, per layer and query head (`index.block_summaries`).

    The worker accumulates `sum over queries of softmax over candidates` per
    (layer, query head) across the probe's steps and reports the rows of its
    heads when `last` is set.
    """

    req_id: str
    query_paged_slots: np.ndarray  # [m] paged slots of the scoring tokens (find their rows)
    query_positions: np.ndarray  # [m] their positions in the pass (for de-rotation)
    candidate_slots: np.ndarray  # [B] host slots of the candidate blocks
    candidate_starts: np.ndarray  # [B] their first token's virtual position
    last: bool  # the probe's final step: report the scores
    query_virtual_offset: int = 0  # virtual - pass position of the queries ("post" kinds)
    # indices into the candidates that a re-rank scores beside the index's best
    rerank_extra: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


@dataclass
class SurprisalOp:
    """Record the surprisal `-log p(x_t | x_<t)` of the tokens one request
    computes in this step (SeKV): the model's own next-token distribution at
    each token's predecessor, in the step's forward pass."""

    req_id: str
    paged_slots: np.ndarray  # [n] every token the request computes this step, in position order
    host_rows: np.ndarray  # [n] host row that keeps each token's surprisal (-1: not kept)
    first_virtual: int  # virtual position of the first of them


@dataclass
class CoarseSummaries:
    """What the worker needs to build one view's SeKV summaries
    (`workspace.coarse_plan.CoarsePlan`, with host rows): summary `s` is the
    surprisal-weighted mean of the pre-RoPE keys (and of the values) of the
    rows `summary_of == s`, its key rotated to view position
    `summary_positions[s]`."""

    host_rows: np.ndarray  # [n] host rows of the summarized history tokens
    virtual_positions: np.ndarray  # [n] where their keys were rotated (to de-rotate them)
    summary_of: np.ndarray  # [n] summary of each, 0 .. S-1
    surprisal: np.ndarray  # [n] float32 weights' numerators (>= 0)
    summary_positions: np.ndarray  # [S] view position of each summary's key
    num_tokens: np.ndarray  # [S] tokens each summary stands for
    history_tokens: int  # the view's history tokens (positions 0 .. history_tokens - 1)


@dataclass
class CoarseOp:
    """SeKV coarse attention of one request served from a view: this step's
    tokens of it get the view's summaries merged into their attention.
    `summaries` comes with the view's first step; the worker keeps them (and
    the view's keys it needs for the merge) until the request is named in
    `StepPlan.coarse_finished`."""

    req_id: str
    query_paged_slots: np.ndarray  # [m] paged slots of the request's tokens in this step
    query_positions: np.ndarray  # [m] their view positions
    summaries: CoarseSummaries | None = None


@dataclass(frozen=True)
class RecordOp:
    """One NVMe record to write from a host slot, or to read into one."""

    block_hash: bytes
    host_slot: int
    start_token: int  # the block's first token's virtual position (checked on read)
    tenant: str  # tenant key (checked on read)


@dataclass
class StepPlan:
    step_id: int
    # Tokens of every request in this step's batch (vLLM's total, sekv's or
    # not): the rows of the step's slot mapping.
    batch_tokens: int = 0
    restores: list[RestoreOp] = field(default_factory=list)
    # Capture: K/V written at paged slot capture_paged_slots[i] in this step's
    # forward go to host row capture_host_rows[i].
    capture_paged_slots: np.ndarray = field(default_factory=_empty)
    capture_host_rows: np.ndarray = field(default_factory=_empty)
    # [n] rotate captured key i by this many positions (virtual - view) before
    # storing it; empty when nothing is captured.
    capture_rope_deltas: np.ndarray = field(default_factory=_empty)
    scores: list[ScoreOp] = field(default_factory=list)
    # Committed blocks to enter the views' block index (the worker indexes
    # them in one batch before its next probe):
    # (host slot, position of the block's first token).
    index_blocks: list[tuple[int, int]] = field(default_factory=list)
    # Per-token surprisal of those blocks (host slot -> [block_tokens] float32,
    # NaN where unknown), for summary kinds that weight tokens by it.
    index_surprisal: dict[int, np.ndarray] = field(default_factory=dict)
    surprisal: list[SurprisalOp] = field(default_factory=list)
    coarse: list[CoarseOp] = field(default_factory=list)
    coarse_finished: list[str] = field(default_factory=list)  # requests whose summaries to drop
    # NVMe tier, all asynchronous in the worker; completions come back in its
    # step report. Deletes run first, before any write of the same step.
    nvme_deletes: list[bytes] = field(default_factory=list)
    nvme_writes: list[RecordOp] = field(default_factory=list)
    # Per-token surprisal of the written blocks (host slot -> [block_tokens]
    # float32), kept in their records' headers; empty when not recorded.
    nvme_write_surprisal: dict[int, np.ndarray] = field(default_factory=dict)
    nvme_reads: list[RecordOp] = field(default_factory=list)
    # The remote tier (a store several servers share): committed blocks to
    # write behind, and blocks to read into their (promoted) host slots.
    remote_writes: list[RecordOp] = field(default_factory=list)
    remote_reads: list[RecordOp] = field(default_factory=list)

    def rewritten_slots(self, block_tokens: int) -> set[int]:
        """Host slots this step writes new bytes into: its captures' and its
        NVMe and remote reads' (every write into the host tier is planned)."""
        captured = np.unique(self.capture_host_rows // block_tokens).tolist()
        return {*captured, *(op.host_slot for op in (*self.nvme_reads, *self.remote_reads))}
