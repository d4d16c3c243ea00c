"""How a view coordinator ranks a probe's candidates: the block index's
scores alone, or fused with lexical scores against the new tokens
(`lexical_weight`); and which candidates it hands the re-rank beside the
index's best (`lexical_candidates`)."""
import numpy as np
import pytest

from vllm_sekv.config import SekvConfig
from vllm_sekv.scheduler_side.view_coordinator import ViewCoordinator
from vllm_sekv.scheduler_side.view_job import ViewJob
from vllm_sekv.workspace.view_passes import ViewBudget, final_pass, first_pass

BT = 16
BUDGET = ViewBudget(block_tokens=BT, view_tokens=12 * BT, sink_tokens=BT, recent_tokens=2 * BT)


def probed(lexical_weight: float) -> tuple[ViewCoordinator, ViewJob]:
    """A 60-block history of filler whose block 5 holds the rare ids the new
    tokens ask about; the index scores later blocks higher."""
    config = SekvConfig(block_tokens=BT, sink_tokens=BT, recent_tokens=2 * BT, lexical_weight=lexical_weight)
    views = ViewCoordinator(config, planner=None, tenant_of=str, window_tokens=4096, capacity_tokens=4096)
    history = (np.arange(60 * BT) % 7 + 100).tolist()
    history[5 * BT : 5 * BT + 4] = [5001, 5002, 5003, 5004]
    prompt = history + [100, 5002, 5004, 101]
    job = ViewJob("r", prompt, "", None, BUDGET)
    job.current = first_pass(len(prompt), 60, BUDGET)
    views.jobs[job.req_id] = job
    views.set_scores(job.req_id, np.linspace(0, 1, len(job.current.candidates), dtype=np.float32)[None])
    job.probe, job.hop_scores = job.current, [job.scores]
    return views, job


def test_without_lexical_weight_the_index_scores_choose_alone():
    views, job = probed(0.0)
    assert views.ranking.selection_scores(job) is job.scores
    assert 5 not in final_pass(job.probe, job.scores.tolist(), BUDGET).history_blocks


def test_lexical_weight_brings_the_block_holding_the_new_tokens_rare_ids_into_the_view():
    views, job = probed(1.0)
    scores = views.ranking.selection_scores(job)
    assert len(scores) == len(job.probe.candidates)
    assert 5 in final_pass(job.probe, scores.tolist(), BUDGET).history_blocks


@pytest.mark.parametrize("count", [1, 3])
def test_lexical_candidates_mark_the_block_holding_the_new_tokens_rare_ids_for_the_rerank(count):
    config = SekvConfig(block_tokens=BT, sink_tokens=BT, recent_tokens=2 * BT, rerank_blocks=4,
                        lexical_candidates=count)
    views = ViewCoordinator(config, planner=None, tenant_of=str, window_tokens=4096, capacity_tokens=4096)
    _, job = probed(0.0)
    probe = views.ranking.with_lexical_candidates(job, first_pass(len(job.prompt), 60, BUDGET))
    marked = [probe.candidates[i] for i in probe.rerank_extra]
    assert len(marked) == count and 5 in marked  # the block holding the rare ids, then its window's
    assert list(probe.rerank_extra) == sorted(probe.rerank_extra)
    assert probe.candidates == job.probe.candidates and probe.history_blocks == job.probe.history_blocks
    unmarked = views.ranking.with_lexical_candidates(job, final_pass(job.probe, job.scores.tolist(), BUDGET))
    assert unmarked.rerank_extra == ()  # only a probe's candidates are marked


def test_without_lexical_candidates_a_probe_marks_none():
    views, job = probed(0.0)
    assert views.ranking.with_lexical_candidates(job, job.probe) is job.probe
