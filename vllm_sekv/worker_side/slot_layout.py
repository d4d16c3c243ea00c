"""A restore op's rows as whole host slots: what a batched or layerwise
device restore copies (each slot once per run of the op's rows in it), and
where each of the slot's tokens goes."""
from __future__ import annotations

import numpy as np

from vllm_sekv.store.slot_runs import run_starts


def slot_of_each_run(slot_of_row: np.ndarray) -> np.ndarray:
    """The slot of each run of rows that stay in one slot, in order."""
    return slot_of_row[run_starts(slot_of_row, step=0)]


def slot_layout(host_rows: np.ndarray, paged_slots: np.ndarray, rope_deltas: np.ndarray | None,
                block_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A restore op as whole host slots: (the slot of each run of the op's
    rows that stay in one slot, in the op's order; the paged slot of each of
    their tokens, -1 for tokens the op does not restore, which the
    cache-update op skips; the RoPE delta of each token), from the op's runs
    of rows in one slot."""
    bt = block_tokens
    slot_of_row = host_rows // bt
    starts = run_starts(slot_of_row, step=0)
    slots = slot_of_row[starts]
    run_of_row = np.zeros(len(host_rows), dtype=np.int64)
    run_of_row[starts[1:]] = 1
    np.cumsum(run_of_row, out=run_of_row)
    run_of_row *= bt
    where = run_of_row + host_rows % bt
    mapping = np.full(len(slots) * bt, -1, dtype=np.int64)
    mapping[where] = paged_slots
    deltas = np.zeros(len(slots) * bt, dtype=np.int64)
    if rope_deltas is not None:
        deltas[where] = rope_deltas
    return slots, mapping, deltas
