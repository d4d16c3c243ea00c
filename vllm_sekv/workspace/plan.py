"""What the worker does in one engine step: the plan the scheduler side sends.

Plain data (numpy int64 arrays, lists), picklable, no vLLM types. Slots of
vLLM's paged cache are `block_id * paged_block_size + offset`; host rows are
`host_slot * block_tokens + offset`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def _empty() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


@dataclass
class RestoreOp:
    """Copy host rows into one request's paged slots, before the forward."""

    req_id: str
    paged_slots: np.ndarray  # [n] destination slots in vLLM's paged cache
    host_rows: np.ndarray  # [n] source rows in the host pool


@dataclass
class StepPlan:
    step_id: int
    restores: list[RestoreOp] = field(default_factory=list)
    # Capture: K/V written at paged slot capture_paged_slots[i] in this step's
    # forward go to host row capture_host_rows[i].
    capture_paged_slots: np.ndarray = field(default_factory=_empty)
    capture_host_rows: np.ndarray = field(default_factory=_empty)
    # Committed blocks whose Mean-K entry the worker must compute now:
    # (host slot, position of the block's first token).
    index_blocks: list[tuple[int, int]] = field(default_factory=list)
    # NVMe tier, all asynchronous in the worker; completions come back in its
    # step report. Deletes run first, before any write of the same step.
    nvme_deletes: list[bytes] = field(default_factory=list)
    nvme_writes: list[tuple[int, bytes, int]] = field(default_factory=list)  # (slot, hash, start)
    nvme_reads: list[tuple[bytes, int, int]] = field(default_factory=list)  # (hash, slot, start)
