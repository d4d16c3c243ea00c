"""What workers report after a step, combined over tensor-parallel ranks."""
import numpy as np
import torch

from vllm_sekv.protocol.metadata import SekvWorkerMeta
from vllm_sekv.index.block_summaries import combine_heads


def test_ranks_reports_combine_conservatively():
    a = SekvWorkerMeta(confirmed_step=7, failed_slots={1}, restore_seconds={"r": 0.2},
                       io_completions=[("write", b"h1", True)])
    b = SekvWorkerMeta(confirmed_step=5, failed_slots={4}, restore_seconds={"r": 0.3},
                       io_completions=[("write", b"h1", False)])
    m = a.aggregate(b)
    assert m.confirmed_step == 5  # confirmed when every rank finished it
    assert m.failed_slots == {1, 4}  # failed if any rank failed it
    assert m.restore_seconds == {"r": 0.3}  # as long as the slowest rank
    assert len(m.io_completions) == 2  # every rank's, counted on the scheduler side


def test_probe_scores_of_each_ranks_heads_are_stacked_and_combine_like_one_rank():
    rng = np.random.default_rng(0)
    per_head = rng.random((4 * 6, 9)).astype(np.float32)  # (layer, head) rows x candidates
    half = len(per_head) // 2
    a = SekvWorkerMeta(0, scores={"r": per_head[:half]})
    b = SekvWorkerMeta(0, scores={"r": per_head[half:], "other": per_head[:1]})
    m = a.aggregate(b)
    assert set(m.scores) == {"r", "other"}
    for combine in ("max", "mean", "top3"):
        whole = combine_heads(torch.from_numpy(per_head), combine)
        torch.testing.assert_close(combine_heads(torch.from_numpy(m.scores["r"]), combine), whole)
