"""Runs of consecutive values: the unit host-tier copies are batched by."""
import numpy as np
import pytest

from vllm_sekv.store.slot_runs import mean_run_length, run_starts, runs


def test_runs_split_at_gaps():
    assert runs([3, 4, 5, 9, 10, 2]) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]
    assert runs(np.zeros(0, dtype=np.int64)) == []


def test_runs_with_a_period_stay_inside_one_slot():
    rows = np.array([2, 3, 4, 5, 9, 10, 7, 8, 12])  # slots of 4 rows
    # [2, 3] | 4 opens slot 1: [4, 5] | a gap: [9, 10] | a gap: [7] | 8 opens slot 2: [8] | a gap: [12]
    assert runs(rows, period=4) == [(0, 2, 2), (2, 4, 2), (4, 9, 2), (6, 7, 1), (7, 8, 1), (8, 12, 1)]
    assert runs([6], period=4) == [(0, 6, 1)]


def test_runs_of_equal_values():
    slot_of_row = np.array([5, 5, 5, 2, 2, 9, 5])
    assert run_starts(slot_of_row, step=0).tolist() == [0, 3, 5, 6]


def test_mean_run_length():
    assert mean_run_length(np.array([3, 4, 5, 9, 10, 2])) == pytest.approx(2.0)
    assert mean_run_length(np.zeros(0, dtype=np.int64)) == 0.0
