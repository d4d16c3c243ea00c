"""How a view job's finished probes become the order its next view takes
history blocks in, and the history's text structure that order reads.

* `selection_scores`: the probes' rankings interleaved
  (`workspace.view_passes.interleave_hops`), with the lexical hop from the
  lead lines after the first (`probe_lexical_hop`,
  `index.lexical.hop_scores`); fused with BM25 against the new tokens
  (`lexical_weight`); the lead lines' look-alikes left out (`view_lookalikes`
  drop, `index.lookalikes`).
* `first_probe_done`: the lead lines (of the first probe's best, the block
  the question names, with the lines it cuts) and the lexical hop from them.
* `with_lexical_candidates`: BM25's best candidates marked for a probe's
  re-rank (`lexical_candidates`).
* `question_blocks`: the blocks of the passages BM25 ranks best against the
  question's words, which the final view takes first (`view_question_passages`).
* `passages`, `lines`: the job's history in passages and lines
  (`workspace.passages`), from the tokenizer's break tokens and words
  (`workspace.vocabulary`), read once per server.

Runs in the engine-core process on the scheduler thread; blocking, numpy.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Callable

import numpy as np

from vllm_sekv.config import SekvConfig
from vllm_sekv.index import lexical
from vllm_sekv.index.lookalikes import LEAD_CANDIDATES, as_words, lead_block, lookalike_mask, question_of
from vllm_sekv.scheduler_side.view_job import ViewJob
from vllm_sekv.workspace.passages import Passages
from vllm_sekv.workspace.view_passes import PassKind, ViewPass, interleave_hops, rank_order
from vllm_sekv.workspace.vocabulary import Vocabulary

logger = logging.getLogger("vllm_sekv")


class ViewRanking:
    def __init__(self, config: SekvConfig, vocabulary: Callable[[], Vocabulary] | None = None) -> None:
        """`vocabulary`: returns the tokenizer's break tokens and words
        (`Vocabulary.of`); called once, here when the server sets
        `view_passage_blocks`, `view_cut_lines` or `view_lookalikes` drop,
        else at the first request that asks for one of them. None: no request
        may ask for passages or lines, and look-alikes compare token ids."""
        self.config = config
        self._read_vocabulary = vocabulary
        self._vocab: Vocabulary | None = None
        needs_breaks = [key for key, on in (("view_passage_blocks", bool(config.view_passage_blocks)),
                                            ("view_cut_lines", config.view_cut_lines == "on"),
                                            ("view_question_passages", bool(config.view_question_passages))) if on]
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

    def vocabulary(self) -> Vocabulary | None:
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

    # ------------------------------------------------------- the history's text

    def passages(self, job: ViewJob) -> Passages | None:
        """The job's history passages, where it asks for them (found once
        per job: its history does not change between passes)."""
        if not job.passage_blocks:
            return None
        if job.passages is None:
            vocab = self.vocabulary()
            if vocab is None:
                job.passage_blocks = 0
                return None
            job.passages = Passages(job.prompt[: job.probe.tail_start], vocab.breaks, job.budget.block_tokens)
        return job.passages

    def _history_lines(self, job: ViewJob) -> Passages | None:
        """The job's history lines (found once per job); None where the
        tokenizer's breaks are unknown."""
        if job.lines is None and (vocab := self.vocabulary()) is not None:
            job.lines = Passages(job.prompt[: job.probe.tail_start], vocab.breaks.lines(), job.budget.block_tokens)
        return job.lines

    def lines(self, job: ViewJob) -> Passages | None:
        """The job's history lines, where it asks for them (`view_cut_lines`)."""
        if not job.cut_lines:
            return None
        lines = self._history_lines(job)
        job.cut_lines = lines is not None
        return lines

    def question_blocks(self, job: ViewJob) -> list[int]:
        """The history blocks of the `job.question_passages` passages that
        BM25 ranks best against the question's words
        (`index.lexical.question_passages`; the question as
        `index.lookalikes.question_of` finds it, words as
        `workspace.vocabulary` defines them), best passage first, each
        passage's blocks in order; kept in `job.question_blocks`. Empty where
        the job asks for none or the tokenizer's words are unknown."""
        vocab = self.vocabulary() if job.question_passages else None
        if vocab is None or vocab.words is None:
            return []
        bt, tail_start = job.budget.block_tokens, job.probe.tail_start
        history = as_words(job.prompt[: tail_start // bt * bt], vocab.words)
        question = as_words(question_of(job.prompt[tail_start:], vocab.turns), vocab.words)
        passages = self.passages(job) or Passages(job.prompt[:tail_start], vocab.breaks, bt)
        ranges = lexical.question_passages(history, question, passages.starts, job.question_passages)
        job.question_blocks = list(dict.fromkeys(b for start, end in ranges for b in range(start // bt,
                                                                                          (end - 1) // bt + 1)))
        return job.question_blocks

    def _lead_lines(self, job: ViewJob, lead: int) -> tuple[int, int]:
        """The tokens of block `lead` with the rest of the lines its
        boundaries cut (the block alone where the tokenizer's breaks are unknown)."""
        lines, bt = self._history_lines(job), job.budget.block_tokens
        return (lead * bt, (lead + 1) * bt) if lines is None else lines.line_span(lead)

    # ------------------------------------------------------------ the ranking

    def first_probe_done(self, job: ViewJob) -> None:
        """After the job's first probe (`job.hop_scores[0]`): its lead lines
        and, with `probe_lexical_hop`, the lexical hop from them, where the
        job drops look-alikes or hops lexically."""
        candidates, hop = job.probe.candidates, self.config.probe_lexical_hop == "on"
        if not candidates or not (hop or job.drop_lookalikes):
            return
        job.history_ids = history = np.asarray(job.prompt[: job.probe.tail_start], dtype=np.int64)
        best = [candidates[i] for i in rank_order(job.hop_scores[0])[:LEAD_CANDIDATES]]
        job.lead = self._lead_lines(job, lead_block(history, best, job.prompt[job.probe.tail_start:],
                                                    job.budget.block_tokens))
        if hop:
            job.lexical_hop = lexical.hop_scores(history, job.lead, candidates, job.budget.block_tokens)

    def selection_scores(self, job: ViewJob) -> np.ndarray:
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
            probe, lines, vocab = job.probe, self._history_lines(job), self.vocabulary()
            spans = None if lines is None else lines.line_spans(np.asarray(probe.candidates, dtype=np.int64))
            words, turns = (None, None) if vocab is None else (vocab.words, vocab.turns)
            mask = lookalike_mask(job.history_ids, probe.candidates, rank_order(scores), job.lead,
                                  job.prompt[probe.tail_start:], job.budget.block_tokens, spans, words, turns)
            scores = np.where(mask, -np.inf, scores)
            job.lookalikes = int(mask.sum())
        return scores

    def with_lexical_candidates(self, job: ViewJob, view: ViewPass) -> ViewPass:
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
