"""Runs of consecutive values in an index array: the unit every copy of
host-tier rows or slots is batched by (one memcpy, one DMA, one slice
assignment per run).

A run is `(start, first, length)`: the index of its first element, that
element's value, and how many elements it spans. Pure numpy.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

Run = tuple[int, int, int]


def run_starts(values: np.ndarray, step: int = 1, period: int = 0) -> np.ndarray:
    """Indices where a run begins: a run goes on while each value is the one
    before plus `step` (0: equal values) and, with a `period`, does not cross
    a multiple of it (e.g. host rows that stay inside one slot)."""
    values = np.asarray(values, dtype=np.int64)
    if not len(values):
        return np.zeros(0, dtype=np.int64)
    breaks = np.diff(values) != step
    if period:
        breaks |= values[1:] % period == 0
    return np.concatenate([[0], np.flatnonzero(breaks) + 1])


def runs(values: Sequence[int] | np.ndarray, period: int = 0) -> list[Run]:
    """The runs of consecutive values (each the one before plus 1), as `(start, first, length)`."""
    values = np.asarray(values, dtype=np.int64)
    starts = run_starts(values, period=period)
    lengths = np.diff(np.append(starts, len(values)))
    return list(zip(starts.tolist(), values[starts].tolist(), lengths.tolist()))


def mean_run_length(values: np.ndarray) -> float:
    """Average length of the runs of consecutive values."""
    return len(values) / max(1, len(run_starts(values)))
