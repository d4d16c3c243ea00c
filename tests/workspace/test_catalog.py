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
    cat = BlockCatalog(num_slots=4, policy=LRUPolicy())
    fill(cat, range(50))
    assert cat.num_committed == 4
    assert cat.stats.evicted_blocks == 46
    assert len({cat.lookup(h(k)).slot for k in range(46, 50)}) == 4


def test_prefix_match_stops_at_first_missing_block():
    cat = BlockCatalog(num_slots=8, policy=LRUPolicy())
    fill(cat, [0, 1, 3])
    assert [r.block_hash for r in cat.match_prefix([h(0), h(1), h(2), h(3)])] == [h(0), h(1)]


def test_reserved_blocks_are_not_matchable_until_committed():
    cat = BlockCatalog(num_slots=2, policy=LRUPolicy())
    rec = cat.reserve(start_token=0)
    assert cat.match_prefix([h(0)]) == []
    cat.commit(rec, h(0))
    assert cat.match_prefix([h(0)]) == [rec]


def test_pinned_and_reserved_blocks_are_never_evicted():
    cat = BlockCatalog(num_slots=2, policy=LRUPolicy())
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
    cat = BlockCatalog(num_slots=3, policy=LRUPolicy())
    a, b = cat.reserve(0), cat.reserve(0)
    assert cat.commit(a, h(7)) and not cat.commit(b, h(7))
    assert cat.lookup(h(7)) is a
    assert cat.reserve(0) is not None and cat.reserve(0) is not None  # b's slot came back


def test_recalled_blocks_survive_a_burst_with_slru():
    cat = BlockCatalog(num_slots=8, policy=SLRUPolicy(8, 0.5))
    hot = fill(cat, [0])
    for _ in range(3):
        cat.touch(hot)
    fill(cat, range(100, 140))
    assert cat.lookup(h(0)) is not None


def test_unpin_below_zero_is_an_error():
    cat = BlockCatalog(num_slots=1, policy=LRUPolicy())
    (a,) = fill(cat, [0])
    with pytest.raises(ValueError):
        cat.unpin([a])
