import pytest

from vllm_sekv.store import LRUPolicy, SLRUPolicy
from vllm_sekv.workspace.catalog import BlockCatalog


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def fill(cat: BlockCatalog, keys):
    recs = []
    for k in keys:
        rec = cat.reserve(start_token=0)
        assert rec is not None
        assert cat.commit(rec, h(k))
        recs.append(rec)
    return recs


def test_budget_is_never_exceeded():
    cat = BlockCatalog(4, LRUPolicy())
    fill(cat, range(50))
    assert cat.num_committed == 4
    assert cat.stats.host_evictions == 46
    assert len({cat.lookup(h(k)).host_slot for k in range(46, 50)}) == 4


def test_prefix_match_stops_at_first_missing_block():
    cat = BlockCatalog(8, LRUPolicy())
    fill(cat, [0, 1, 3])
    assert [r.block_hash for r in cat.match_prefix([h(0), h(1), h(2), h(3)])] == [h(0), h(1)]


def test_reserved_blocks_are_not_matchable_until_committed():
    cat = BlockCatalog(2, LRUPolicy())
    rec = cat.reserve(start_token=0)
    assert cat.match_prefix([h(0)]) == []
    cat.commit(rec, h(0))
    assert cat.match_prefix([h(0)]) == [rec]


def test_pinned_and_reserved_blocks_are_never_evicted():
    cat = BlockCatalog(2, LRUPolicy())
    (a,) = fill(cat, [0])
    cat.pin([a])
    pending = cat.reserve(start_token=0)  # takes the last free slot
    assert pending is not None
    assert cat.reserve(start_token=0) is None  # nothing evictable
    assert cat.stats.reserve_failures == 1
    cat.unpin([a])
    assert cat.reserve(start_token=0) is not None  # now `a` goes
    assert cat.lookup(h(0)) is None


def test_duplicate_commit_releases_the_second_copy():
    cat = BlockCatalog(3, LRUPolicy())
    a, b = cat.reserve(0), cat.reserve(0)
    assert cat.commit(a, h(7)) and not cat.commit(b, h(7))
    assert cat.lookup(h(7)) is a
    assert cat.reserve(0) is not None and cat.reserve(0) is not None  # b's slot came back


def test_recalled_blocks_survive_a_burst_with_slru():
    cat = BlockCatalog(8, SLRUPolicy(8, 0.5))
    hot = fill(cat, [0])
    for _ in range(3):
        cat.touch(hot)
    fill(cat, range(100, 140))
    assert cat.lookup(h(0)) is not None


def test_unpin_below_zero_is_an_error():
    cat = BlockCatalog(1, LRUPolicy())
    (a,) = fill(cat, [0])
    with pytest.raises(ValueError):
        cat.unpin([a])


# ----------------------------------------------------------------- NVMe tier

from vllm_sekv.workspace.catalog import NvmeState  # noqa: E402


def tiered(host=2, nvme=4):
    return BlockCatalog(host, LRUPolicy(), nvme, LRUPolicy())


def test_committed_blocks_are_written_behind_and_then_survive_host_eviction():
    cat = tiered()
    (a,) = fill(cat, [0])
    assert a.nvme is NvmeState.WRITING
    fill(cat, [1])
    assert cat.reserve(0) is None  # both host blocks are still being written: no victim
    cat.write_done(h(0), ok=True)
    assert a.nvme is NvmeState.STORED
    assert cat.reserve(0) is not None  # a loses its host copy ...
    assert a.host_slot is None and cat.lookup(h(0)) is a  # ... and stays matchable on NVMe
    assert not a.restorable


def test_promotion_reads_back_and_a_failed_read_is_a_miss():
    cat = tiered()
    (a,) = fill(cat, [0])
    cat.write_done(h(0), ok=True)
    cat.write_done(h(1), ok=True)
    fill(cat, [1])
    cat.write_done(h(1), ok=True)
    fill(cat, [2])  # evicts a's host copy
    assert a.host_slot is None
    assert cat.promote(a) and a.loading and not a.restorable
    cat.read_done(h(0), ok=True)
    assert a.restorable
    # the same after a failed read: forgotten, and its file is to be deleted
    b = cat.lookup(h(1))
    assert b.host_slot is None and cat.promote(b)
    cat.read_done(h(1), ok=False)
    assert cat.lookup(h(1)) is None and h(1) in cat.take_deletes()


def test_nvme_budget_is_never_exceeded_and_evicted_files_are_deleted():
    cat = tiered(host=8, nvme=3)
    for k in range(6):
        fill(cat, [k])
        cat.write_done(h(k), ok=True)
        assert cat.num_nvme_used <= 3
    assert cat.num_nvme_used == 3
    assert set(cat.take_deletes()) == {h(0), h(1), h(2)}
    assert all(cat.lookup(h(k)).nvme is NvmeState.NONE for k in range(3))  # still on host


def test_failed_write_keeps_the_host_copy_only():
    cat = tiered()
    (a,) = fill(cat, [0])
    cat.write_done(h(0), ok=False)
    assert a.nvme is NvmeState.NONE and a.restorable and cat.num_nvme_used == 0


def test_records_found_at_start_up_beyond_the_budget_are_deleted_oldest_first():
    cat = tiered(nvme=2)
    for k in range(3):  # a scan lists records oldest first
        assert cat.add_stored(h(k), 32 * k)
    assert cat.take_deletes() == [h(0)] and cat.lookup(h(0)) is None
    assert cat.lookup(h(2)).start_token == 64 and not cat.lookup(h(2)).restorable


def test_each_tenant_sees_only_its_own_block_count():
    cat = BlockCatalog(8, LRUPolicy())
    for i in range(3):
        cat.commit(cat.reserve(0, tenant="a"), h(i))
    cat.commit(cat.reserve(0, tenant="b"), h(9))
    assert cat.tenant_blocks("a") == 3 and cat.tenant_blocks("b") == 1 and cat.tenant_blocks("c") == 0


def test_a_tenant_at_its_share_evicts_its_own_blocks_never_anothers():
    cat = BlockCatalog(8, LRUPolicy(), host_share=3)
    for i in range(3):
        cat.commit(cat.reserve(0, tenant="b"), h(10 + i))
    for i in range(3):
        cat.commit(cat.reserve(0, tenant="a"), h(i))
    # a holds its share (free slots remain): its next block takes the slot of a's oldest
    cat.commit(cat.reserve(0, tenant="a"), h(3))
    assert h(0) not in cat and all(h(k) in cat for k in (1, 2, 3))
    assert all(h(10 + i) in cat for i in range(3)) and cat.num_host_used == 6
    # a burst of a's blocks never touches b's
    for i in range(4, 20):
        cat.commit(cat.reserve(0, tenant="a"), h(i))
    assert all(h(10 + i) in cat for i in range(3)) and cat.tenant_blocks("a") == 3


def test_a_tenant_at_its_share_with_nothing_to_give_up_gets_no_slot():
    cat = BlockCatalog(4, LRUPolicy(), host_share=1)
    pending = cat.reserve(0, tenant="a")  # reserved, not evictable
    assert pending is not None and cat.reserve(0, tenant="a") is None
    assert cat.reserve(0, tenant="b") is not None  # others are not held back


def test_nvme_shares_work_the_same_way():
    cat = BlockCatalog(8, LRUPolicy(), num_nvme_records=4, nvme_policy=LRUPolicy(), nvme_share=2)
    for i in range(3):
        cat.commit(cat.reserve(0, tenant="a"), h(i))
        cat.write_done(h(i), True)
    stored = [k for k in range(3) if cat.lookup(h(k)).nvme is NvmeState.STORED]
    assert stored == [1, 2]  # the share is 2: a's first record went for its third
    assert cat.take_deletes() == [h(0)]


@pytest.mark.parametrize("old, new", [([0, 1, 2], [0, 1, 2]), ([0, 1, 2], [0, 1, 2, 3]), ([0, 1, 2, 3], [0, 1]),
                                      ([0, 1, 2], [3, 1, 2]), ([], [0, 1]), ([2, 3], [])])
def test_repinning_leaves_every_block_pinned_as_unpinning_the_old_and_pinning_the_new_would(old, new):
    cat = BlockCatalog(8, LRUPolicy())
    recs = fill(cat, range(4))
    cat.pin([recs[i] for i in old])
    cat.repin([recs[i] for i in old], [recs[i] for i in new])
    assert [rec.pins for rec in recs] == [new.count(i) for i in range(4)]
