import random

import pytest

from vllm_sekv.store.policy import LRUPolicy, SLRUPolicy, make_policy


def _burst_survivor(policy, capacity: int) -> bool:
    """Fill, recall block 0 repeatedly, then push a burst of new blocks through
    a tier of `capacity`; report whether block 0 is still held."""
    held = set()

    def admit(key):
        if len(held) == capacity:
            victim = policy.victim()
            policy.remove(victim)
            held.discard(victim)
        policy.insert(key)
        held.add(key)

    for k in range(capacity):
        admit(k)
    for _ in range(3):
        policy.touch(0)
    for k in range(1000, 1000 + 3 * capacity):
        admit(k)
    return 0 in held


def test_slru_keeps_recalled_block_through_a_burst():
    assert _burst_survivor(SLRUPolicy(capacity=8, protected_fraction=0.5), 8)


def test_lru_loses_it_so_the_check_above_can_fail():
    assert not _burst_survivor(LRUPolicy(), 8)


def test_victim_skips_pinned_keys_and_prefers_probation():
    p = SLRUPolicy(capacity=4, protected_fraction=0.5)
    for k in range(4):
        p.insert(k)
    p.touch(0)  # 0 -> protected
    assert p.victim() == 1
    assert p.victim(skip=lambda k: k in (1, 2, 3)) == 0
    assert p.victim(skip=lambda k: True) is None


def test_protected_segment_is_bounded():
    p = SLRUPolicy(capacity=4, protected_fraction=0.5)
    for k in range(4):
        p.insert(k)
        p.touch(k)
    assert sum(p.is_protected(k) for k in range(4)) == 2
    assert len(p) == 4


def test_make_policy():
    assert isinstance(make_policy("lru", 4), LRUPolicy)
    assert isinstance(make_policy("slru", 4), SLRUPolicy)


@pytest.mark.parametrize("make", [LRUPolicy, lambda: SLRUPolicy(capacity=6, protected_fraction=0.5)])
def test_touching_all_at_once_orders_like_touching_each_in_turn(make):
    rng = random.Random(0)
    one, each = make(), make()
    for _ in range(200):
        key = rng.randrange(12)
        if rng.random() < 0.3:
            one.insert(key), each.insert(key)
        else:
            keys = [rng.randrange(14) for _ in range(rng.randrange(6))]  # some never inserted
            one.touch_all(keys)
            for k in keys:
                each.touch(k)
        assert vars(one) == vars(each)  # the same keys in the same order, segment by segment
        victim = one.victim()
        if victim is not None and rng.random() < 0.2:
            one.remove(victim), each.remove(victim)
