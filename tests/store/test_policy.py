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
