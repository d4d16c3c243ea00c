"""Probe scoring, worker side: a probe pass's queries score the block index.

A probe pass (`workspace.view_passes`) runs a request's newest tokens against a
short sink + recent view; while it runs, every layer's queries for those
tokens score the candidate history blocks of the session's index
(`BlockIndex.score`: per query head, the sum over queries of the softmax over
candidates), accumulated over the layers and over the pass's steps. After the
last layer of its last step the probe is done: its rows per (layer, query
head), or on a single rank already combined into one row, go to the
scheduler side in the step's report, which picks the view's blocks with them.

With `rerank_blocks` set, the probe also keeps its queries layer by layer,
and at the end the index's best candidates are scored again with their
actual keys (`worker_side.rerank`; over the model's retrieval heads only
with `rerank_heads_path`), together with the candidates the
scheduler side names (`ScoreOp.rerank_extra`: BM25's best, config
`lexical_candidates`); the report is then one row, those candidates first,
in their re-ranked order.

With a SeKV zoom router (config `router_path`) the router scores instead: the
probe's pre-RoPE queries are kept layer by layer and, at the end, scored
where the index lives against the candidates' surprisal-weighted mean keys;
the report is two rows, the router's relevance and each candidate's restore
rank.

Runs in the worker process, on the forward thread: `begin` at a step's first
layer, `observe` before each layer's attention, `take_done` after the forward.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np
import torch

from vllm_sekv.worker_side.rerank import KeyReader, rerank
from vllm_sekv.ops import rotate_keys
from vllm_sekv.store.host_pool import to_device
from vllm_sekv.index.block_index import BlockIndex
from vllm_sekv.workspace.step_plan import ScoreOp
from vllm_sekv.index.router import FULL_RANK
from vllm_sekv.index.block_summaries import combine_heads

logger = logging.getLogger("vllm_sekv")

# (found [n] bool, batch row of each found paged slot), for `n` paged slots
RowLookup = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]


class ProbeScorer:
    """One per worker: the probes of the current step, and each probe's
    scores accumulated over its steps until it is done."""

    def __init__(self, index: BlockIndex, router: Any, geometry: Any, rope: Any, block_tokens: int,
                 index_combine: str, rerank_blocks: int = 0, rerank_distance: int = 0,
                 read_keys: KeyReader | None = None, rerank_heads: list[int] | None = None) -> None:
        if rerank_blocks and (read_keys is None or geometry.world_size > 1):
            raise ValueError("sekv config 'rerank_blocks': the re-rank needs every query head on one "
                             "rank; tensor parallelism is not supported yet")
        if router is not None and geometry.world_size > 1:
            raise ValueError("sekv config 'router_path': the zoom router needs every query head "
                             "on one rank; tensor parallelism is not supported yet")
        self.index = index
        self.rerank_blocks = rerank_blocks
        self.rerank_distance = rerank_distance
        self.read_keys = read_keys
        # the (layer * query heads + head) indices the re-rank combines (None: all)
        self.rerank_heads = None if rerank_heads is None else torch.tensor(rerank_heads, device=index.device)
        self.router = router.to(index.device) if router is not None else None  # scores where the index is
        self.geometry = geometry
        self.rope = rope
        self.block_tokens = block_tokens
        self.index_combine = index_combine
        # This step's probes: (op, batch rows of its queries, their positions, its candidate slots).
        self._step: list[tuple[ScoreOp, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._acc: dict[str, torch.Tensor] = {}  # req_id -> [L, Hq, B], over the probe's steps
        self._router_queries: dict[str, list[list[torch.Tensor]]] = {}  # req_id -> per layer
        # Re-rank: per request, the probe's queries (post-RoPE) per layer and their positions.
        self._rerank_queries: dict[str, tuple[list[list[torch.Tensor]], list[torch.Tensor]]] = {}
        self._done: dict[str, np.ndarray] = {}

    @property
    def active(self) -> bool:
        """Whether this step's forward has probe queries to score."""
        return bool(self._step)

    def clear_step(self) -> None:
        self._step = []

    def begin(self, ops: list[ScoreOp], rows_of: RowLookup, batch_device: torch.device) -> None:
        """This step's probes, their queries found in the batch (`rows_of`).
        Queries missing from the batch do not score (a warning)."""
        device = self.index.device
        self._step = []
        for op in ops:
            found, rows = rows_of(op.query_paged_slots)
            if not found.all():
                logger.warning("sekv: %d probe queries missing from the batch", int((~found).sum()))
            self._step.append((op, to_device(rows, batch_device), to_device(op.query_positions[found], device),
                               to_device(op.candidate_slots, device)))

    def observe(self, layer_idx: int, query: torch.Tensor) -> None:
        """Layer `layer_idx`'s queries (post-RoPE, as attention receives
        them, `[tokens, q_heads * head_dim]`): score each probe's candidates."""
        head_dim = self.geometry.head_dim
        for op, rows, positions, candidates in self._step:
            if self.router is not None:
                self._route(op, layer_idx, query, rows, positions)
                continue
            acc = self._acc.get(op.req_id)
            if len(rows):
                device = self.index.device
                q = query[rows].reshape(len(rows), -1, head_dim).float().to(device)
                if self.rerank_blocks:
                    self._keep_query(op.req_id, layer_idx, query[rows].reshape(len(rows), -1, head_dim), positions)
                q = rotate_keys(q, -positions, self.rope)  # pre-RoPE
                if self.index.query_space == "post":
                    q = rotate_keys(q, positions + op.query_virtual_offset, self.rope)
                part = self.index.score(layer_idx, q, candidates)
                if acc is None:
                    acc = torch.zeros((self.geometry.num_layers, *part.shape), dtype=torch.float32, device=device)
                    self._acc[op.req_id] = acc
                acc[layer_idx] += part
            if op.last and layer_idx == self.geometry.num_layers - 1:
                acc = self._acc.pop(op.req_id, None)
                kept = self._rerank_queries.pop(op.req_id, None)
                if acc is not None and kept is not None:
                    self._done[op.req_id] = self._reranked(acc, kept, op)
                else:
                    self._done[op.req_id] = self._score_rows(acc, op)

    def unobserved(self, ops: list[ScoreOp]) -> None:
        """This step's probes ran in a forward that showed no layer's queries
        (a full CUDA graph replay): a probe ending here reports what its
        earlier steps scored, if anything (nothing: the scheduler side ranks
        by recency, with a warning)."""
        for op in ops:
            if op.last:
                self._router_queries.pop(op.req_id, None)
                self._rerank_queries.pop(op.req_id, None)
                acc = self._acc.pop(op.req_id, None) if self.router is None else None
                self._done[op.req_id] = self._score_rows(acc, op)

    def take_done(self) -> dict[str, np.ndarray]:
        """The probes finished since the last call: req_id -> report rows."""
        done, self._done = self._done, {}
        return done

    def _score_rows(self, acc: torch.Tensor | None, op: ScoreOp) -> np.ndarray:
        """A finished probe's report: its rows per (layer, query head), or,
        on a single rank, already combined into one row (the scheduler side
        combines what the ranks send; one row combines to itself), so that a
        long history's scores cross to the scheduler as one row."""
        if acc is None:
            return np.zeros((0, len(op.candidate_slots)), dtype=np.float32)
        rows = acc.reshape(-1, acc.shape[-1])
        if self.geometry.world_size == 1:
            rows = combine_heads(rows, self.index_combine)[None]
        return rows.cpu().numpy()

    def _keep_query(self, req_id: str, layer_idx: int, query: torch.Tensor, positions: torch.Tensor) -> None:
        """Keep a probe step's queries of one layer (and, at its first layer,
        their positions) for the re-rank."""
        layers, positions_kept = self._rerank_queries.setdefault(
            req_id, ([[] for _ in range(self.geometry.num_layers)], []))
        layers[layer_idx].append(query.to(self.index.device))
        if layer_idx == 0:
            positions_kept.append(positions)

    def _reranked(self, acc: torch.Tensor, kept: tuple[list[list[torch.Tensor]], list[torch.Tensor]],
                  op: ScoreOp) -> np.ndarray:
        """One row: the index's `rerank_blocks` best indexed candidates and
        the op's `rerank_extra` ones first (1 + their re-rank mass), then the
        others by their index score scaled into [0, 1)."""
        device = self.index.device
        combined = combine_heads(acc.reshape(-1, acc.shape[-1]), self.index_combine)
        slots = torch.as_tensor(op.candidate_slots, device=device)
        valid = self.index.valid[slots]
        count = min(self.rerank_blocks, int(valid.sum()))
        if count == 0 or not kept[0][0]:
            return combined[None].cpu().numpy()
        top = combined.masked_fill(~valid, float("-inf")).topk(count).indices
        if len(op.rerank_extra):
            chosen = torch.zeros_like(valid)
            chosen[top] = True
            chosen[torch.as_tensor(op.rerank_extra, device=device)] = True
            top = (chosen & valid).nonzero().squeeze(1)
        queries = torch.stack([torch.cat(chunks) for chunks in kept[0]])  # [L, m, Hq, D]
        positions = torch.cat(kept[1])
        mass = rerank(queries, positions, slots[top].tolist(), torch.as_tensor(op.candidate_starts, device=device)[top],
                      self.read_keys, self.rope, self.rerank_distance, self.index_combine,
                      heads=self.rerank_heads)
        out = combined.clamp_min(0) / (combined.max().clamp_min(1e-30) * 2)
        out[top] = 1.0 + mass
        return out[None].cpu().numpy()

    def _route(self, op: ScoreOp, layer_idx: int, query: torch.Tensor, rows: torch.Tensor,
               positions: torch.Tensor) -> None:
        """SeKV zoom router: keep the probe's pre-RoPE queries layer by layer;
        after the last layer of its last step, the router scores the candidate
        blocks' surprisal-weighted mean keys with all of them. Two rows: the
        router's combined relevance `P` (over layers and heads), and the rank
        of each candidate's tier (`rank_levels[max(tier, 1)]`: a block the view
        takes although the router would keep it coarse moves at the lowest
        expand rank; FULL_RANK, and unindexed candidates, move exact)."""
        kept = self._router_queries.setdefault(op.req_id, [[] for _ in range(self.geometry.num_layers)])
        if len(rows):  # kept where the forward runs: no host copy per layer
            q = query[rows].reshape(len(rows), -1, self.geometry.head_dim).float()
            kept[layer_idx].append(rotate_keys(q, -positions.to(q.device), self.rope))
        if not (op.last and layer_idx == self.geometry.num_layers - 1):
            return
        del self._router_queries[op.req_id]
        dev = self.index.device  # the router scores where the index lives (a whole history's candidates)
        slots = torch.from_numpy(op.candidate_slots).to(dev)
        valid = self.index.valid[slots]
        combined = torch.zeros(len(slots), dtype=torch.float32, device=dev)
        ranks = torch.full((len(slots),), FULL_RANK, dtype=torch.float32, device=dev)
        if kept[0]:
            queries = torch.stack([torch.cat(chunks) for chunks in kept]).to(dev)  # [L, M, Hq, D]
            keys = self.index.entries[slots[valid], :, 0].float().transpose(0, 1)
            if keys.shape[1]:
                tokens = torch.full((keys.shape[1],), self.block_tokens, dtype=torch.int64, device=dev)
                scores = self.router.scores(queries, keys, tokens)
                combined[valid] = scores.combined.float()
                levels = torch.tensor(self.router.rank_levels, dtype=torch.float32, device=dev)
                ranks[valid] = levels[scores.tiers.clamp_min(1)]
        self._done[op.req_id] = torch.stack([combined, ranks]).cpu().numpy()
