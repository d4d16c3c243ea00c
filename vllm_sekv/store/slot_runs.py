"""Runs of consecutive values in an index array: the unit every copy of
host-tier rows or slots is batched by (one memcpy, one DMA, one slice
assignment per run).

A run is `(start, first, length)`: the index of its first element, that
element's value, and how many elements it spans. Pure numpy; `whole_slots`
(host rows split into runs of whole slots) gives torch index tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

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


@dataclass(frozen=True)
class SlotRuns:
    """Host rows split for a slot-wise write: `whole` = (index of the run's
    first row, its first slot, number of slots) for runs of whole consecutive
    slots; `rest` = indices of the other rows."""

    whole: list[tuple[int, int, int]]
    rest: torch.Tensor


def whole_slots(rows: torch.Tensor | np.ndarray, block_tokens: int) -> SlotRuns:
    """Split flat host rows (slot * block_tokens + offset) into runs of whole
    consecutive slots, each given in order (offsets 0..block_tokens-1, slot
    after slot), and the rest."""
    bt = block_tokens
    r = np.asarray(rows.numpy() if isinstance(rows, torch.Tensor) else rows, dtype=np.int64)
    whole: list[tuple[int, int, int]] = []
    rest: list[np.ndarray] = []
    for start, first, length in runs(r):  # rows that follow each other, across slots
        head = min((-first) % bt, length)  # rows before the run's first slot boundary
        slots = (length - head) // bt
        if not slots:
            rest.append(np.arange(start, start + length))
            continue
        whole.append((start + head, (first + head) // bt, slots))
        rest += [np.arange(start, start + head), np.arange(start + head + slots * bt, start + length)]
    rest_idx = torch.from_numpy(np.concatenate(rest)) if rest else torch.zeros(0, dtype=torch.int64)
    return SlotRuns(whole, rest_idx)
