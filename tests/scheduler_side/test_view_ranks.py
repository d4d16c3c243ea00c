"""Which rank each block of a view moves at under a lossy `restore_codec`:
"lowrank(r)" factors every block but the sink's at rank r; "router" takes each
selected block's rank from the zoom router's report (a calibrated router file,
`benchmarks/results/router_calibration/router_smollm2.pt`), and the response counts blocks per rank."""
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_sekv.config import SekvConfig
from vllm_sekv.scheduler_side.view_coordinator import ViewCoordinator
from vllm_sekv.scheduler_side.view_job import ViewJob
from vllm_sekv.workspace.step_plan import LowRankBlock, lowrank_blocks
from vllm_sekv.workspace.segments import Segments
from vllm_sekv.workspace.view_passes import ViewBudget, final_pass, first_pass

ROUTER = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "router_calibration" / "router_smollm2.pt"
BT = 16
BUDGET = ViewBudget(block_tokens=BT, view_tokens=12 * BT, sink_tokens=BT, recent_tokens=2 * BT)


def coordinator(**sekv) -> ViewCoordinator:
    config = SekvConfig(block_tokens=BT, sink_tokens=BT, recent_tokens=2 * BT, **sekv)
    return ViewCoordinator(config, planner=None, tenant_of=str, window_tokens=4096, capacity_tokens=4096)


def probed_job(views: ViewCoordinator, rows: np.ndarray) -> ViewJob:
    """A 30-block history probed; `rows` as the worker reports them."""
    prompt = list(range(30 * BT + 5))
    job = ViewJob("r", prompt, "", None, BUDGET)
    job.current = first_pass(len(prompt), 30, BUDGET)
    views.jobs[job.req_id] = job
    views.set_scores(job.req_id, rows)
    job.probe, job.hop_scores = job.current, [job.scores]
    return job


def test_lowrank_r_factors_every_history_block_but_the_sinks_at_rank_r():
    views = coordinator(restore_codec="lowrank(8)")
    job = probed_job(views, np.linspace(0, 1, 27, dtype=np.float32)[None])
    view = final_pass(job.probe, job.scores.tolist(), BUDGET)
    ranks = views._block_ranks(job, view)
    assert ranks == {b: 8 for b in view.history_blocks if b > 0}
    assert 0 in view.history_blocks and 0 not in ranks


@pytest.fixture
def routed():
    """A router-codec coordinator and a job whose router report rates the
    candidates' ranks 8, 16 and full (-1) in turn, the later blocks best."""
    views = coordinator(surprisal="on", router_path=str(ROUTER), restore_codec="router")
    candidates = 27  # blocks 1..27: all but the sink (0) and the recent window (28, 29)
    ranks = np.resize(np.array([8, 16, -1], dtype=np.float32), candidates)
    job = probed_job(views, np.stack([np.linspace(0, 1, candidates, dtype=np.float32), ranks]))
    return views, job


def test_the_router_codec_takes_each_selected_blocks_rank_from_the_router(routed):
    views, job = routed
    assert job.probe.candidates == tuple(range(1, 28))
    assert job.ranks.tolist() == np.resize([8, 16, -1], 27).tolist()
    view = final_pass(job.probe, job.scores.tolist(), BUDGET)
    chosen = [b for b in view.history_blocks if b in job.probe.candidates]
    assert len(chosen) >= 3
    ranks = views._block_ranks(job, view)
    # candidate block b sits at index b - 1: rank 8, 16, full (exact, left out) in turn
    assert ranks == {b: [8, 16][(b - 1) % 3] for b in chosen if (b - 1) % 3 != 2}
    assert not {0, 28, 29} & set(ranks)  # sink and recent move exact


def test_lowrank_blocks_carry_their_rank_and_surprisal_pieces(routed):
    views, job = routed
    view = final_pass(job.probe, job.scores.tolist(), BUDGET)
    ranks = views._block_ranks(job, view)
    b = min(ranks)
    starts = torch.tensor([0, b * BT + 5, b * BT + 11])  # two segment starts inside block b
    ends = torch.tensor([b * BT + 5, b * BT + 11, 30 * BT])
    segments = Segments(starts, ends, torch.ones(3, dtype=torch.bool))
    blocks = lowrank_blocks(view.history_blocks, BT, segments, ranks)
    assert set(blocks) == set(ranks)
    assert blocks[b] == LowRankBlock(ranks[b], ((0, 5), (5, 11), (11, BT)))
    assert all(blk.pieces == ((0, BT),) for k, blk in blocks.items() if k != b)


def test_without_the_routers_ranks_every_block_moves_exact(routed):
    views, job = routed
    job.current = job.probe
    views.set_scores(job.req_id, job.scores[None])  # a report without the rank row
    view = final_pass(job.probe, job.scores.tolist(), BUDGET)
    assert job.ranks is None and views._block_ranks(job, view) == {}
