"""A request served from execution views: its passes' state, from admission
to its response (`view_coordinator.ViewCoordinator` owns one per request).

Plain data, no behaviour beyond the job's own tokens and clock; the
coordinator runs the passes and `view_ranking` ranks the probes' candidates.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_sekv.workspace.coarse_plan import CoarsePlan
from vllm_sekv.workspace.hashing import JoinedTokens
from vllm_sekv.workspace.passages import Passages
from vllm_sekv.workspace.step_plan import LowRankBlock
from vllm_sekv.workspace.view_passes import ViewBudget, ViewPass


@dataclass
class ViewJob:
    req_id: str
    prompt: list[int]  # the full prompt: history + new tokens, virtual positions 0..
    tenant: str  # the client's tenant key (`workspace.tenants`), for the workspace's hashes
    session_id: str | None
    budget: ViewBudget
    current: ViewPass | None = None  # None: chosen at the next `next_pass`
    probe: ViewPass | None = None  # the last probe run (every hop scores the same candidates)
    scores: np.ndarray | None = None  # the running probe's report: combined relevance of its candidates
    hop_scores: list[np.ndarray] = field(default_factory=list)  # each finished probe's scores, in order
    lexical_hop: np.ndarray | None = None  # the lexical hop's scores (`probe_lexical_hop`), after the first probe
    lead: tuple[int, int] | None = None  # the lead lines' tokens (`index.lookalikes`): the lexical hop's start
    drop_lookalikes: bool = False  # leave the lead lines' look-alikes out (server setting, likewise)
    lookalikes: int = 0  # candidates the last ranking left out as look-alikes
    history_ids: np.ndarray | None = None  # the history's token ids (int64), made once where the lead block is chosen
    probe_hops: int = 1  # probes before the final view (server setting, a request may choose its own)
    hop_gain: float = 0.0  # how a later hop favours what it lifts (`interleave_hops`; likewise)
    context_blocks: int = 0  # neighbours each selected block brings (server setting, likewise)
    passage_blocks: int = 0  # most blocks of its passage each selected block brings (likewise)
    select_blocks: int = 0  # most blocks a view selects, 0: its room (likewise)
    passages: Passages | None = None  # the history's passages, found at the first probe that needs them
    cut_lines: bool = False  # complete the lines the selected blocks' boundaries cut (likewise)
    lines: Passages | None = None  # the history's lines, found where the lead lines or the final view need them
    question_passages: int = 0  # passages text retrieval adds to the final view (server setting, likewise)
    question_blocks: list[int] = field(default_factory=list)  # their blocks, best passage first
    ranks: np.ndarray | None = None  # the zoom router's rank per probe candidate (<= 0: exact); None: no report
    num_passes: dict[str, int] = field(default_factory=dict)
    # [kind, chosen, done] of each pass, seconds since admission (done: None
    # for the sampling pass); where a view step's time goes.
    timeline: list[list] = field(default_factory=list)
    admitted_at: float = field(default_factory=time.monotonic)
    prefilled_tokens: int = 0  # prompt tokens computed, over all passes
    ingested_to: int = 0  # virtual end of the last ingest pass
    truncated: bool = False  # the workspace could not hold the history (see `next_pass`)
    coarse: bool = False  # SeKV summaries for the left-out history (server setting, request may opt out)
    # Selected blocks the final view recomputes, and whether in virtual order
    # (server settings, a request may choose its own; never with coarse).
    recompute_blocks: int = 0
    recompute_in_order: bool = False
    # The final view's SeKV parts (`_final_pass`): its summaries and its
    # lossily restored blocks (virtual block -> rank, pieces); None for other passes.
    coarse_plan: CoarsePlan | None = None
    lowrank: dict[int, LowRankBlock] | None = None
    # BM25 scores of the probe's candidates against its new tokens (`lexical_weight`,
    # `lexical_candidates`): computed once per probe, keyed by its tail's start.
    lexical: tuple[int, np.ndarray] | None = None

    def virtual_tokens(self, request: Any) -> JoinedTokens:
        """The full history in virtual order, prompt then generated tokens
        (joined, not copied: asked for at every new block)."""
        return JoinedTokens(self.prompt, request.output_token_ids)

    def seconds(self) -> float:
        """Seconds since admission, to the millisecond."""
        return round(time.monotonic() - self.admitted_at, 3)
