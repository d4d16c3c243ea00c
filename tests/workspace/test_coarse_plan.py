"""Which history tokens SeKV summaries stand for (`workspace.coarse_plan`)."""
import numpy as np
import pytest

from vllm_sekv.workspace.coarse_plan import plan_summaries
from vllm_sekv.workspace.segments import segment

ALPHA = 2.0


def history(n=400, seed=0):
    rng = np.random.default_rng(seed)
    h = rng.gamma(2.0, 1.5, n).astype(np.float32)
    h[rng.choice(n, 20, replace=False)] += 15.0  # clear anchors
    return h


def test_every_left_out_token_but_anchors_enters_exactly_one_summary():
    h = history()
    view = np.r_[0:64, 160:192, 350:400]
    plan = plan_summaries(h, view, ALPHA, max_summaries=1000)
    anchors = set(segment(h, ALPHA).anchors.tolist())
    expected = [p for p in range(len(h)) if p not in set(view.tolist()) and p not in anchors]
    assert plan.positions.tolist() == expected
    assert np.all(np.diff(plan.summary_of) >= 0)
    assert plan.num_tokens.sum() == len(expected) and np.all(plan.num_tokens > 0)
    # One summary per segment that has left-out tokens, in order.
    seg_of = segment(h, ALPHA).segment_of(plan.positions).numpy()
    assert len(np.unique(seg_of)) == plan.num_summaries
    assert np.array_equal(np.unique(seg_of, return_inverse=True)[1], plan.summary_of)
    np.testing.assert_array_equal(plan.surprisal, h[plan.positions])


def test_summary_positions_are_where_their_tokens_would_sit_in_the_view():
    h = history()
    view = np.r_[0:64, 160:192, 350:400]
    plan = plan_summaries(h, view, ALPHA, max_summaries=1000)
    firsts = plan.positions[np.searchsorted(plan.summary_of, np.arange(plan.num_summaries))]
    assert plan.summary_positions.tolist() == [int((view < f).sum()) for f in firsts]


def test_too_many_segments_merge_into_consecutive_groups():
    h = history()
    view = np.r_[0:64]
    full = plan_summaries(h, view, ALPHA, max_summaries=1000)
    few = plan_summaries(h, view, ALPHA, max_summaries=5)
    assert full.num_summaries > 5 and few.num_summaries == 5
    np.testing.assert_array_equal(few.positions, full.positions)
    assert few.num_tokens.sum() == full.num_tokens.sum()
    assert np.all(np.diff(few.summary_of) >= 0)  # groups of consecutive segments
    # A segment never splits over two groups.
    for s in range(full.num_summaries):
        assert len(np.unique(few.summary_of[full.summary_of == s])) == 1


def test_a_view_holding_the_whole_history_has_no_summaries():
    h = history(100)
    assert plan_summaries(h, np.arange(100), ALPHA, 50).num_summaries == 0
    assert plan_summaries(h, np.arange(10), ALPHA, 0).num_summaries == 0


def test_unknown_surprisal_weighs_nothing_and_bad_views_raise():
    h = history(100)
    h[40:60] = np.nan
    plan = plan_summaries(h, np.arange(10), ALPHA, 50)
    assert np.all(np.isfinite(plan.surprisal)) and np.all(plan.surprisal >= 0)
    with pytest.raises(ValueError):
        plan_summaries(h, [5, 3], ALPHA, 10)
    with pytest.raises(ValueError):
        plan_summaries(h, [100], ALPHA, 10)
