"""Execution views, scheduler side: one job per request served from views.

A request whose prompt is longer than its view budget becomes a `ViewJob`
(`view_job`).
The job runs the request as a series of passes (`workspace.view_passes`): each time
vLLM asks the connector for matched tokens (`next_pass`), the job chooses the
pass, rewrites the request's tokens into it (with a cache salt of its own, so
vLLM's prefix cache never mixes view KV with real prompt KV) and hands the
pass to the planner, which restores its history part with re-RoPE. When a
non-sampling pass has computed its last token, the scheduler hook takes the
request out of the engine and queues it again (`passes_done`, `pass_done`);
the next `next_pass` continues. The last pass samples, and its new and
generated tokens are saved at their virtual positions. Which history blocks
a probe's hop or the final view takes is `view_ranking`'s.

Runs in the engine-core process on the scheduler thread; every call is
blocking and cheap, except scoring results (`set_scores`), which combine one
row per (layer, query head).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from vllm_sekv import compat, request_params
from vllm_sekv.config import ROUTER_CODEC, SekvConfig
from vllm_sekv.store.codecs import parse_codec
from vllm_sekv.workspace.coarse_plan import plan_summaries
from vllm_sekv.workspace.step_plan import lowrank_blocks
from vllm_sekv.workspace.planner import WorkspacePlanner
from vllm_sekv.workspace.vocabulary import Vocabulary
from vllm_sekv.workspace.segments import anchors_by_surprisal, segment
from vllm_sekv.index.block_summaries import combine_heads
from vllm_sekv.scheduler_side.view_job import ViewJob
from vllm_sekv.scheduler_side.view_ranking import ViewRanking
from vllm_sekv.workspace.view_passes import (
    PassKind, ViewBudget, ViewPass, final_pass, first_pass, hop_probe, rank_order, truncated_pass,
)

logger = logging.getLogger("vllm_sekv")

PROBE_RANKED = 128  # best candidates of each probe a multi-hop view's response reports (`probe_ranked`)


class ViewCoordinator:
    def __init__(
        self, config: SekvConfig, planner: WorkspacePlanner, tenant_of: Callable[[str], str], window_tokens: int,
        capacity_tokens: int, vocabulary: Callable[[], Vocabulary] | None = None,
    ) -> None:
        """`vocabulary`: returns the tokenizer's break tokens and words
        (`Vocabulary.of`), for the probes' ranking (`ViewRanking`, which says
        when it calls it); None: no request may ask for passages or lines, and
        look-alikes compare token ids."""
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
        self.ranking = ViewRanking(config, vocabulary)

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
        job.question_passages = self.config.view_question_passages if params.view_question_passages is None \
            else params.view_question_passages
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
                view = hop_probe(job.probe, self.ranking.selection_scores(job), job.budget, job.context_blocks,
                                 self.ranking.passages(job), job.passage_blocks)
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
                    view = self.ranking.with_lexical_candidates(job, first_pass(len(job.prompt), matched, job.budget))
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
        view = final_pass(job.probe, self.ranking.selection_scores(job), budget, job.context_blocks, anchors,
                          budget.view_tokens * cfg.anchor_percent // 100, coarse_room, job.recompute_blocks,
                          job.recompute_in_order, self.ranking.passages(job), job.passage_blocks, job.select_blocks,
                          self.ranking.lines(job), self.ranking.question_blocks(job))
        if coarse_room:
            job.coarse_plan = plan_summaries(surprisal, view.history_positions(), cfg.anchor_alpha,
                                             view.reserved_tokens)
        if cfg.restore_codec != "exact":
            job.lowrank = lowrank_blocks(view.history_blocks, view.block_tokens, segments,
                                         self._block_ranks(job, view))
        return view

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
            if len(job.hop_scores) == 1:
                self.ranking.first_probe_done(job)
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
            if job.question_passages:  # text retrieval's passages, best first, as blocks
                out["question_blocks"] = job.question_blocks
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
