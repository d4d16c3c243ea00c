"""GPU block pool bookkeeping: diff, LRU eviction, protection, capacity errors."""
import pytest
import torch

from vllm_sekv.store.gpu_pool import GpuBlockPool, LruRows


def test_diff_splits_resident_and_incoming_in_selection_order():
    lru = LruRows(4)
    rows = lru.admit([10, 11])
    d = lru.diff([12, 11, 13, 10])
    assert d.incoming == [12, 13]
    assert d.resident == [(11, rows[1]), (10, rows[0])]
    assert len(lru) == 2  # diff changes nothing


def test_diff_rejects_duplicates():
    with pytest.raises(ValueError, match="twice"):
        LruRows(2).diff([1, 1])


def test_admit_evicts_least_recently_used_unprotected():
    lru = LruRows(3)
    r = dict(zip([1, 2, 3], lru.admit([1, 2, 3])))
    lru.touch([1])  # order now 2, 3, 1
    new = lru.admit([4], protected=[2])
    assert 3 not in lru and 2 in lru and 1 in lru
    assert new == [r[3]]  # the freed row is reused
    assert sorted(lru.row_of(b) for b in (1, 2, 4)) == sorted(r.values())


def test_admit_raises_and_changes_nothing_when_too_small():
    lru = LruRows(2)
    lru.admit([1, 2])
    with pytest.raises(RuntimeError, match="too small"):
        lru.admit([3, 4], protected=[1])
    assert 1 in lru and 2 in lru and len(lru) == 2


def test_step_sequence_moves_only_missing_blocks():
    lru = LruRows(6)
    moved = []
    for selection in ([0, 1, 2, 3], [0, 2, 4, 5], [0, 4, 5, 6], [0, 1, 2, 3]):
        d = lru.diff(selection)
        lru.admit(d.incoming, protected=selection)
        lru.touch(selection)
        moved.append(d.incoming)
    assert moved[:3] == [[0, 1, 2, 3], [4, 5], [6]]
    # capacity 6 after [0..6]: 1 was least recent and evicted for 6; 2, 3 still resident.
    assert moved[3] == [1]


def test_invalidate_frees_rows():
    lru = LruRows(1)
    lru.admit([5])
    lru.invalidate([5, 99])
    assert 5 not in lru
    assert lru.admit([6]) == [0]


def test_gpu_block_pool_allocates_block_layout():
    pool = GpuBlockPool(3, (2, 4, 32, 2, 8), torch.float16, "cpu")
    assert pool.data.shape == (3, 2, 4, 32, 2, 8)
    assert pool.block_bytes == 2 * 4 * 32 * 2 * 8 * 2
    rows = pool.admit([7, 8])
    assert pool.diff([8, 9]).resident == [(8, rows[1])]
    with pytest.raises(ValueError):
        GpuBlockPool(1, (4, 32, 2, 8), torch.float16, "cpu")
