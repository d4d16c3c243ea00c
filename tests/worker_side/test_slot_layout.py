"""A restore op as whole host slots (`slot_layout`, what a CUDA restore
copies): every restored row lands at its paged slot and delta, rows the op
does not restore are skipped (-1), slots come in the op's order."""
import numpy as np

from vllm_sekv.worker_side.slot_layout import slot_layout

BT = 4


def _check(host_rows, paged, deltas):
    slots, mapping, got_deltas = slot_layout(np.asarray(host_rows), np.asarray(paged),
                                             None if deltas is None else np.asarray(deltas), BT)
    assert len(mapping) == len(got_deltas) == len(slots) * BT
    # expand the layout back into (host row -> paged slot, delta) and compare
    restored = {}
    for i, slot in enumerate(slots):
        for t in range(BT):
            if mapping[i * BT + t] >= 0:
                restored.setdefault(slot * BT + t, []).append((mapping[i * BT + t], got_deltas[i * BT + t]))
    want = {}
    for r, p, d in zip(host_rows, paged, deltas if deltas is not None else [0] * len(paged)):
        want.setdefault(r, []).append((p, d))
    assert {k: sorted(v) for k, v in restored.items()} == {k: sorted(v) for k, v in want.items()}
    return slots


def test_slots_in_the_ops_order_with_partial_first_and_last_blocks():
    rows = [10, 11, 20, 21, 22, 23, 4, 5, 6]  # slot 2 from row 2, slot 5 whole, slot 1 to row 2
    slots = _check(rows, list(range(100, 109)), [7, 7, -3, -3, -3, -3, 0, 0, 0])
    assert slots.tolist() == [2, 5, 1]
    _, mapping, _ = slot_layout(np.asarray(rows), np.arange(100, 109), None, BT)
    assert mapping[:4].tolist() == [-1, -1, 100, 101]  # rows 8, 9 of slot 2 are not restored


def test_a_slot_met_twice_is_laid_out_twice_and_nothing_is_lost():
    slots = _check([8, 9, 4, 5, 10, 11], [1, 2, 3, 4, 5, 6], None)
    assert slots.tolist() == [2, 1, 2]


def test_no_rows():
    slots, mapping, deltas = slot_layout(np.zeros(0, np.int64), np.zeros(0, np.int64), None, BT)
    assert len(slots) == len(mapping) == len(deltas) == 0
