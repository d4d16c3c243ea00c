"""Execution views, scheduler side: one job per request served from views.

A request whose prompt is longer than its view budget becomes a `ViewJob`.
The job runs the request as a series of passes (`workspace.view_passes`): each time
vLLM asks the connector for matched tokens (`next_pass`), the job chooses the
pass, rewrites the request's tokens into it (with a cache salt of its own, so
vLLM's prefix cache never mixes view KV with real prompt KV) and hands the
pass to the planner, which restores its history part with re-RoPE. When a
non-sampling pass has computed its last token, the scheduler hook takes the
request out of the engine and queues it again (`passes_done`, `pass_done`);
the next `next_pass` continues. The last pass samples, and its new and
generated tokens are saved at their virtual positions.

Runs in the engine-core process on the scheduler thread; every call is
blocking and cheap, except scoring results (`set_scores`), which combine one
row per (layer, query head).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from vllm_sekv import compat, request_params
from vllm_sekv.config import ROUTER_CODEC, SekvConfig
from vllm_sekv.store.codecs import parse_codec
from vllm_sekv.workspace.coarse_plan import CoarsePlan, plan_summaries
from vllm_sekv.workspace.hashing import JoinedTokens
from vllm_sekv.workspace.step_plan import LowRankBlock, lowrank_blocks
from vllm_sekv.workspace.planner import WorkspacePlanner
from vllm_sekv.workspace.passages import Passages
from vllm_sekv.workspace.vocabulary import Vocabulary
from vllm_sekv.workspace.segments import anchors_by_surprisal, segment
from vllm_sekv.index import lexical
from vllm_sekv.index.block_summaries import combine_heads
from vllm_sekv.index.lookalikes import LEAD_CANDIDATES, lead_block, lookalike_mask
from vllm_sekv.workspace.view_passes import (
    PassKind, ViewBudget, ViewPass, final_pass, first_pass, hop_probe, interleave_hops, rank_order, truncated_pass,
)

logger = logging.getLogger("vllm_sekv")

PROBE_RANKED = 128  # best candidates of each probe a multi-hop view's response reports (`probe_ranked`)


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


class ViewCoordinator:
    def __init__(
        self, config: SekvConfig, planner: WorkspacePlanner, tenant_of: Callable[[str], str], window_tokens: int,
        capacity_tokens: int, vocabulary: Callable[[], Vocabulary] | None = None,
    ) -> None:
        """`vocabulary`: returns the tokenizer's break tokens and words
        (`Vocabulary.of`); called once, at start-up when the server sets
        `view_passage_blocks`, `view_cut_lines` or `view_lookalikes` drop,
        else at the first request that asks for one of them. None: no request
        may ask for passages or lines, and look-alikes compare token ids."""
        self.config = config
        self.planner = planner
        self.tenant_of = tenant_of  # a client's cache salt -> its tenant key
        self.window_tokens = window_tokens
        bt = config.block_tokens
        view = config.view_tokens or window_tokens
        self.view_tokens = min(view, window_tokens, capacity_tokens) // bt * bt
        least = config.sink_tokens + config.recent_tokens + 2 * bt
        if self.view_tokens < least:
            raise ValueError(
                f"sekv config 'view_tokens': views of {self.view_tokens} tokens (the model's "
                f"window is {window_tokens}, the KV cache holds {capacity_tokens}) leave no room "
                f"next to sink_tokens + recent_tokens; at least {least} are needed"
            )
        self.jobs: dict[str, ViewJob] = {}
        # restore_codec "lowrank(r)": r; 0 for "exact" and "router" (ranks per block).
        codec = config.restore_codec
        self.codec_rank = 0 if codec in ("exact", ROUTER_CODEC) else parse_codec(codec).rank
        self._read_vocabulary = vocabulary
        self._vocab: Vocabulary | None = None
        needs_breaks = [key for key, on in (("view_passage_blocks", bool(config.view_passage_blocks)),
                                            ("view_cut_lines", config.view_cut_lines == "on")) if on]
        if needs_breaks and vocabulary is None:
            raise ValueError(f"sekv config '{needs_breaks[0]}': this server has no tokenizer to find "
                             f"passage and line breaks with")
        if needs_breaks or (config.view_lookalikes == "drop" and vocabulary is not None):
            self._vocab = self._read()

    def _read(self) -> Vocabulary:
        started = time.monotonic()
        vocab = self._read_vocabulary()
        logger.info("sekv: the tokenizer's break tokens and words found in %.1f s", time.monotonic() - started)
        return vocab

    def _vocabulary(self) -> Vocabulary | None:
        """The tokenizer's break tokens and words, read at the first call; None where it
        cannot be loaded (logged once: no passages or cut lines, look-alikes by token ids)."""
        if self._vocab is None and self._read_vocabulary is not None:
            try:
                self._vocab = self._read()
            except Exception as e:  # noqa: BLE001 - a request must not stop the engine
                logger.warning("sekv: no passage or line breaks (%s); views take selected blocks without "
                               "their passages or cut lines, and look-alikes compare token ids", e)
                self._read_vocabulary = None
        return self._vocab

    # ------------------------------------------------------------ admission

    def budget_for(self, max_tokens: int, view_tokens: int | None = None) -> ViewBudget:
        """The view budget of a request that may generate `max_tokens`: the
        view and its generation fit the model's window; a generation too long
        for that shrinks the view to at most half the window (and is then cut
        at the window, see `clamp_max_tokens`). `view_tokens` (the request's
        own, at most the server's) lowers the budget further."""
        cfg, bt = self.config, self.config.block_tokens
        least = cfg.sink_tokens + cfg.recent_tokens + 2 * bt
        view = min(self.view_tokens, view_tokens or self.view_tokens)
        room = max(self.window_tokens - max_tokens, min(view, self.window_tokens // 2))
        tokens = max(min(view, room) // bt * bt, least)
        return ViewBudget(bt, tokens, cfg.sink_tokens, cfg.recent_tokens)

    def serves_from_views(self, request: Any) -> bool:
        """Whether `admit` will make `request` a view job: its prompt exceeds its budget."""
        budget = self.budget_for(request.max_tokens, request_params.of_request(request).view_tokens)
        return len(request.prompt_token_ids or ()) > budget.view_tokens

    def admit(self, request: Any) -> bool:
        """Make `request` a view job if its prompt exceeds its budget; either
        way keep its generation inside the model's window."""
        prompt = list(request.prompt_token_ids or ())
        params = request_params.of_request(request)
        budget = self.budget_for(request.max_tokens, params.view_tokens)
        if len(prompt) <= budget.view_tokens:
            compat.clamp_max_tokens(request, self.window_tokens - len(prompt))
            return False
        job = ViewJob(request.request_id, prompt, self.tenant_of(compat.request_cache_salt(request)),
                      params.session_id, budget)
        job.coarse = self.config.coarse == "on" and params.coarse is not False
        job.recompute_blocks = self.config.recompute_blocks if params.recompute_blocks is None \
            else params.recompute_blocks
        job.recompute_in_order = (params.recompute_layout or self.config.recompute_layout) == "in_order"
        job.probe_hops = params.probe_hops or self.config.probe_hops
        job.hop_gain = self.config.probe_hop_gain if params.probe_hop_gain is None else params.probe_hop_gain
        job.context_blocks, job.passage_blocks = self._extents(params)
        job.select_blocks = self.config.view_select_blocks if params.view_select_blocks is None \
            else params.view_select_blocks
        job.cut_lines = self.config.view_cut_lines == "on" if params.view_cut_lines is None \
            else params.view_cut_lines
        job.drop_lookalikes = (params.view_lookalikes or self.config.view_lookalikes) == "drop"
        if job.coarse and job.recompute_blocks:  # refused at the API (`request_params.check`)
            logger.warning("sekv: request %s asks to recompute blocks beside coarse summaries; its view "
                           "restores them", job.req_id)
            job.recompute_blocks = 0
        self.jobs[job.req_id] = job
        # Until its first pass is chosen the request must not hit vLLM's
        # prefix cache under its real tokens.
        compat.hide_from_prefix_cache(request, self._pass_salt(job))
        return True

    def _extents(self, params: request_params.RequestParams) -> tuple[int, int]:
        """(neighbours, passage blocks) each selected block brings: the
        server's, unless the request names one of them (then it decides both:
        a request that asks for neighbours gets no passages, and the reverse)."""
        cfg = self.config
        context, passage = params.view_context_blocks, params.view_passage_blocks
        if context is None and passage is None:
            return cfg.view_context_blocks, cfg.view_passage_blocks
        if passage is None:
            return context, 0 if context else cfg.view_passage_blocks
        if context is None:
            return 0 if passage else cfg.view_context_blocks, passage
        return context, passage

    def _passages(self, job: ViewJob) -> Passages | None:
        """The job's history passages, where it asks for them (found once
        per job: its history does not change between passes)."""
        if not job.passage_blocks:
            return None
        if job.passages is None:
            vocab = self._vocabulary()
            if vocab is None:
                job.passage_blocks = 0
                return None
            job.passages = Passages(job.prompt[: job.probe.tail_start], vocab.breaks, job.budget.block_tokens)
        return job.passages

    def _history_lines(self, job: ViewJob) -> Passages | None:
        """The job's history lines (found once per job); None where the
        tokenizer's breaks are unknown."""
        if job.lines is None and (vocab := self._vocabulary()) is not None:
            job.lines = Passages(job.prompt[: job.probe.tail_start], vocab.breaks.lines(), job.budget.block_tokens)
        return job.lines

    def _lines(self, job: ViewJob) -> Passages | None:
        """The job's history lines, where it asks for them."""
        if not job.cut_lines:
            return None
        lines = self._history_lines(job)
        job.cut_lines = lines is not None
        return lines

    def _lead_lines(self, job: ViewJob, lead: int) -> tuple[int, int]:
        """The tokens of block `lead` with the rest of the lines its
        boundaries cut (the block alone where the tokenizer's breaks are unknown)."""
        lines, bt = self._history_lines(job), job.budget.block_tokens
        return (lead * bt, (lead + 1) * bt) if lines is None else lines.line_span(lead)

    def _pass_salt(self, job: ViewJob) -> str:
        n = sum(job.num_passes.values())
        return f"{job.tenant}\x00sekv-view:{job.req_id}:{n}"

    # ---------------------------------------------------------------- passes

    def next_pass(self, request: Any) -> int | None:
        """Choose the request's pass if not chosen yet, rewrite the request into
        it; the tokens vLLM restores, or None while NVMe reads run."""
        job = self.jobs[request.request_id]
        if job.current is None:
            if job.probe is not None and len(job.hop_scores) < job.probe_hops:
                view = hop_probe(job.probe, self._selection_scores(job), job.budget, job.context_blocks,
                                 self._passages(job), job.passage_blocks)
            elif job.probe is not None:
                view = self._final_pass(job)
            else:
                matched = self.planner.match_history(job.req_id, job.prompt, job.tenant,
                                                     job.session_id)
                if matched is None:
                    return None
                if matched * job.budget.block_tokens < job.ingested_to:
                    # What the last ingest computed is not held any more (the
                    # tier is too small for this history): ingesting again would
                    # never end. Serve the prompt's end instead, and say so.
                    job.truncated = True
                    logger.warning(
                        "sekv: the workspace cannot hold the %d-token history of %s (host_bytes too "
                        "small); this step is served from its last tokens only", len(job.prompt),
                        job.req_id)
                    view = truncated_pass(len(job.prompt), matched, job.budget)
                else:
                    view = self._with_lexical_candidates(job, first_pass(len(job.prompt), matched, job.budget))
            if view.kind is PassKind.INGEST:
                job.ingested_to = view.tail_start + view.tail_tokens
            job.current = view
            job.num_passes[view.kind.value] = job.num_passes.get(view.kind.value, 0) + 1
            job.timeline.append([view.kind.value, job.seconds(), None])
            job.prefilled_tokens += view.num_tokens - view.history_tokens - (0 if view.samples else 1)
            compat.rewrite_request(request, view.token_ids(job.prompt), self._pass_salt(job))
            if view.samples:
                compat.clamp_max_tokens(request, self.window_tokens - view.num_tokens)
        return self.planner.begin_view_pass(job.req_id, job.current, job.coarse_plan, job.lowrank)

    def _final_pass(self, job: ViewJob) -> ViewPass:
        """The sampling view after the job's probe, with SeKV's parts where
        surprisal is recorded: anchors, coarse summaries of the history it
        leaves out (taking room in its budget), and the history blocks that a
        lossy `restore_codec` factors."""
        cfg, budget = self.config, job.budget
        surprisal = self.planner.history_surprisal(job.req_id)
        if surprisal is not None:
            surprisal = surprisal[: job.probe.tail_start]  # the tail is computed in the view
        segments = segment(surprisal, cfg.anchor_alpha) if surprisal is not None and len(surprisal) else None
        anchors = anchors_by_surprisal(segments, surprisal) if cfg.anchor_percent else []
        coarse_room = budget.view_tokens * cfg.coarse_percent // 100 if job.coarse and segments is not None else 0
        view = final_pass(job.probe, self._selection_scores(job), budget, job.context_blocks, anchors,
                          budget.view_tokens * cfg.anchor_percent // 100, coarse_room, job.recompute_blocks,
                          job.recompute_in_order, self._passages(job), job.passage_blocks, job.select_blocks,
                          self._lines(job))
        if coarse_room:
            job.coarse_plan = plan_summaries(surprisal, view.history_positions(), cfg.anchor_alpha,
                                             view.reserved_tokens)
        if cfg.restore_codec != "exact":
            job.lowrank = lowrank_blocks(view.history_blocks, view.block_tokens, segments,
                                         self._block_ranks(job, view))
        return view

    def _selection_scores(self, job: ViewJob) -> np.ndarray:
        """The finished probes' candidate scores (their hops interleaved, the
        lexical hop after the first), fused with the candidates' lexical
        scores against the new tokens where `lexical_weight` is set; the
        lead lines' look-alikes at -inf where the job drops them."""
        hops = job.hop_scores if job.lexical_hop is None else [job.hop_scores[0], job.lexical_hop,
                                                                 *job.hop_scores[1:]]
        scores = interleave_hops(hops, job.hop_gain)
        if self.config.lexical_weight:
            scores = lexical.fuse(scores, self._lexical_scores(job, job.probe), self.config.lexical_weight)
        if job.drop_lookalikes and job.lead is not None:
            probe, lines, vocab = job.probe, self._history_lines(job), self._vocabulary()
            spans = None if lines is None else lines.line_spans(np.asarray(probe.candidates, dtype=np.int64))
            words, turns = (None, None) if vocab is None else (vocab.words, vocab.turns)
            mask = lookalike_mask(job.history_ids, probe.candidates, rank_order(scores), job.lead,
                                  job.prompt[probe.tail_start:], job.budget.block_tokens, spans, words, turns)
            scores = np.where(mask, -np.inf, scores)
            job.lookalikes = int(mask.sum())
        return scores

    def _with_lexical_candidates(self, job: ViewJob, view: ViewPass) -> ViewPass:
        """A probe with the `lexical_candidates` candidates that BM25 ranks
        best against its new tokens marked for the re-rank (ties: the
        earliest); any other pass unchanged."""
        count = self.config.lexical_candidates
        if not count or view.kind is not PassKind.PROBE or not view.candidates:
            return view
        scores = self._lexical_scores(job, view)
        best = np.argsort(-scores, kind="stable")[:count]
        return replace(view, rerank_extra=tuple(sorted(best[scores[best] > 0].tolist())))

    @staticmethod
    def _lexical_scores(job: ViewJob, probe: ViewPass) -> np.ndarray:
        """BM25 score of each of `probe`'s candidates against its new tokens
        (`index.lexical.block_scores`), computed once per probe."""
        if job.lexical is None or job.lexical[0] != probe.tail_start:
            history = np.asarray(job.prompt[: probe.tail_start], dtype=np.int64)
            scores = lexical.block_scores(history, job.prompt[probe.tail_start:], job.budget.block_tokens)
            job.lexical = (probe.tail_start, scores[list(probe.candidates)])
        return job.lexical[1]

    def _block_ranks(self, job: ViewJob, view: ViewPass) -> dict[int, int]:
        """Virtual block -> rank of the view's history blocks that a lossy
        `restore_codec` factors: with "lowrank(r)" every block but the sink's
        (a rebuilt attention sink costs the most accuracy, `store.codecs`) at
        rank r; with "router" each candidate at the rank the router gave it
        (the sink, the recent window and blocks it rated exact move exact)."""
        if self.codec_rank:
            sink = job.budget.sink_tokens
            return {b: self.codec_rank for b in view.history_blocks if b * view.block_tokens >= sink}
        if job.ranks is None:
            return {}
        held = set(view.history_blocks)
        return {b: r for b, r in zip(job.probe.candidates, job.ranks.tolist()) if r > 0 and b in held}

    def max_new_tokens(self, request: Any, num_computed_tokens: int, num_new_tokens: int) -> int:
        """Stop a non-sampling pass one token short of its end (the sentinel)."""
        job = self.jobs.get(request.request_id)
        if job is None or job.current is None or job.current.samples:
            return num_new_tokens
        return max(0, min(num_new_tokens, job.current.num_tokens - 1 - num_computed_tokens))

    def passes_done(self, requests: Iterable[Any]) -> list[Any]:
        """Requests among `requests` whose non-sampling pass is complete."""
        done = []
        for request in requests:
            job = self.jobs.get(request.request_id)
            if job is None or job.current is None or job.current.samples:
                continue
            if compat.finished_tokens(request) < job.current.num_tokens - 1:
                continue  # its last chunk is still running (asynchronous scheduling)
            if job.current.kind is PassKind.PROBE and job.scores is None:
                continue  # the probe's report is still on its way
            done.append(request)
        return done

    def pass_done(self, request: Any, tokens_of: Any) -> None:
        """The request was taken out of the engine after a non-sampling pass."""
        job = self.jobs[request.request_id]
        self.planner.end_pass(job.req_id, tokens_of)
        job.timeline[-1][2] = job.seconds()
        if job.current.kind is PassKind.PROBE:
            job.probe = job.current
            job.hop_scores.append(job.scores)
            job.scores = None
            candidates, hop = job.probe.candidates, self.config.probe_lexical_hop == "on"
            if len(job.hop_scores) == 1 and candidates and (hop or job.drop_lookalikes):
                job.history_ids = history = np.asarray(job.prompt[: job.probe.tail_start], dtype=np.int64)
                best = [candidates[i] for i in rank_order(job.hop_scores[0])[:LEAD_CANDIDATES]]
                job.lead = self._lead_lines(job, lead_block(history, best, job.prompt[job.probe.tail_start:],
                                                            job.budget.block_tokens))
                if hop:
                    job.lexical_hop = lexical.hop_scores(history, job.lead, candidates, job.budget.block_tokens)
        job.current = None
        # vLLM looks the request up in its prefix cache before asking for its
        # next pass: the finished pass's blocks (cached under its salt) must not match.
        compat.rewrite_request(request, list(request.prompt_token_ids), self._pass_salt(job) + ":next")

    def set_scores(self, req_id: str, rows: np.ndarray) -> None:
        """A probe's per-(layer, query head) relevance rows arrived."""
        job = self.jobs.get(req_id)
        if job is None or job.current is None or job.current.kind is not PassKind.PROBE:
            return
        if len(rows) == 0:  # no query was seen: rank by recency
            job.scores = np.arange(len(job.current.candidates), dtype=np.float32)
            logger.warning("sekv: probe of %s scored no query; the view takes recent blocks", req_id)
            return
        if self.config.router_path:  # one rank: the router's combined relevance, then its ranks
            job.scores = rows[0].astype(np.float32)
            job.ranks = rows[1].astype(np.int64) if len(rows) > 1 else None
            return
        job.scores = combine_heads(torch.from_numpy(rows), self.config.index_combine).numpy()

    # ------------------------------------------------------------- the end

    def virtual_progress(self, request: Any) -> tuple[Sequence[int], int] | None:
        """(virtual tokens, how many of them are computed) of a view job."""
        job = self.jobs.get(request.request_id)
        if job is None:
            return None
        tokens = job.virtual_tokens(request)
        view = job.current
        if view is None:
            return tokens, 0
        computed = max(0, compat.finished_tokens(request) - view.tail_view_start) + view.tail_start
        return tokens, min(computed, len(tokens))

    def finish(self, request: Any) -> dict[str, Any] | None:
        """Forget the job; what the response reports about its views."""
        job = self.jobs.pop(request.request_id, None)
        if job is None:
            return None
        view = job.current
        out: dict[str, Any] = {
            "passes": dict(job.num_passes),
            "pass_seconds": job.timeline,
            "prompt_tokens": len(job.prompt),
            "prefilled_tokens": job.prefilled_tokens,
        }
        if job.truncated:
            out["truncated"] = True
        if view is not None and view.samples:
            out["view_tokens"] = view.num_tokens
            out["block_tokens"] = view.block_tokens
            out["selected_blocks"] = list(view.history_blocks) + list(view.recomputed)
            out["ranked_blocks"] = list(view.ranked)
            if len(job.hop_scores) > 1:  # each probe's own best candidates, for what one hop adds to another
                out["probe_ranked"] = [[job.probe.candidates[i] for i in rank_order(s)[:PROBE_RANKED]]
                                       for s in job.hop_scores]
            if job.lexical_hop is not None:  # likewise, the lexical hop's
                out["lexical_hop_ranked"] = [job.probe.candidates[i]
                                             for i in rank_order(job.lexical_hop)[:PROBE_RANKED]]
            if job.drop_lookalikes:
                out["lookalike_blocks"] = job.lookalikes
            if view.recomputed:
                out["recomputed_blocks"] = len(view.recomputed)
            if view.anchors:
                out["anchor_tokens"] = len(view.anchors)
            if job.lowrank is not None:  # blocks per restore rank (lossy restore_codec)
                ranks = [job.lowrank[b].rank if b in job.lowrank else "exact" for b in view.history_blocks]
                out["block_ranks"] = {str(r): ranks.count(r) for r in dict.fromkeys(ranks)}
            if job.coarse_plan is not None and job.coarse_plan.num_summaries:
                out["summaries"] = job.coarse_plan.num_summaries
                out["summary_tokens"] = int(job.coarse_plan.num_tokens.sum())
        return out

    def tokens_of(self, request: Any) -> Sequence[int] | None:
        job = self.jobs.get(request.request_id)
        return job.virtual_tokens(request) if job is not None else None
