import pytest

from vllm_sekv.workspace.hashing import JoinedTokens, PrefixHashMemo, extend_block_hashes


def hashes(tokens, salt="", bt=4):
    return extend_block_hashes([], tokens, bt, salt)


def test_only_full_blocks_are_hashed():
    assert len(hashes(list(range(11)))) == 2


def test_shared_prefix_shares_blocks_and_divergence_changes_all_later_ones():
    a = hashes([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    b = hashes([1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12])
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]


def test_salt_separates_tenants():
    assert hashes(list(range(8)), salt="a") != hashes(list(range(8)), salt="b")
    assert hashes(list(range(8)), salt="a") == hashes(list(range(8)), salt="a")


def test_extension_is_incremental():
    tokens = list(range(20))
    part = extend_block_hashes([], tokens[:9], 4, "s")
    assert extend_block_hashes(part, tokens, 4, "s") == hashes(tokens, salt="s")


def test_extension_up_to_an_end_hashes_that_prefix_only():
    tokens = list(range(20))
    assert extend_block_hashes([], tokens, 4, "s", end=11) == hashes(tokens[:11], salt="s")
    assert extend_block_hashes([], tokens, 4, "s", end=99) == hashes(tokens, salt="s")


def test_the_memo_gives_the_hashes_of_hashing_from_scratch_and_reuses_a_shared_prefix(monkeypatch):
    import random

    from vllm_sekv.workspace import hashing

    rng = random.Random(0)
    history = [rng.randrange(50000) for _ in range(400)]
    memo = hashing.PrefixHashMemo(block_tokens=4, capacity_tokens=1000)
    calls = []
    real = hashing.extend_block_hashes

    def counting(hashes, token_ids, bt, salt):
        before = len(hashes)
        out = real(hashes, token_ids, bt, salt)
        calls.append(len(out) - before)
        return out

    monkeypatch.setattr(hashing, "extend_block_hashes", counting)
    cases = [
        (history[:201], "s", "agent"),                       # first: everything hashed
        (history[:201] + [7, 8, 9, 10, 11], "s", "agent"),   # the next step: only the new blocks
        (history[:150] + [1] + history[151:300], "s", "agent"),  # an edit in block 37
        (history[:140] + [2, 3, 4, 5, 6], "s", "agent"),     # a new question after block 34
        (history[:300], "t", "agent"),                       # another tenant: nothing shared
        (history[:40], "s", "agent"),                        # shorter
        (history[:300], "s", None),                          # no session: its own entry
    ]
    for tokens, salt, key in cases:
        got = memo.hashes(tokens, salt, key)
        assert got == real([], tokens, 4, salt)
    got = memo.hashes(history[:300], "s", None)  # the same again
    assert got == real([], history[:300], 4, "s")
    # blocks hashed per call: all; the new one; those from the edit's block on
    # (75 - 37); those after block 34; all (another salt); none (a prefix of
    # the last prompt); all; none
    assert calls == [50, 1, 38, 1, 75, 0, 75, 0]


def test_the_memo_keeps_a_copy_and_stays_within_its_capacity():
    from vllm_sekv.workspace.hashing import PrefixHashMemo

    memo = PrefixHashMemo(block_tokens=4, capacity_tokens=100)
    tokens = list(range(80))
    first = memo.hashes(tokens, "s", "a")
    tokens[3] = -1  # the caller rewrites its list: the memo must not follow
    assert memo.hashes(tokens, "s", "a") == extend_block_hashes([], tokens, 4, "s") != first
    memo.hashes(list(range(60)), "s", "b")  # 80 + 60 > 100: the oldest entry goes
    assert memo._tokens <= 100 and ("s", "a") not in memo._entries
    memo.hashes(list(range(500)), "s", "c")  # longer than the capacity: not kept
    assert ("s", "c") not in memo._entries


def test_shared_blocks_is_the_longest_whole_block_common_prefix():
    import random

    from vllm_sekv.workspace.hashing import shared_blocks

    rng = random.Random(1)
    for _ in range(300):
        bt = rng.choice([1, 4, 32])
        old = [rng.randrange(3) for _ in range(rng.randrange(0, 200))]
        new = list(old)
        for _ in range(rng.randrange(0, 3)):  # up to two changes
            if new:
                new[rng.randrange(len(new))] = rng.randrange(3)
        new += [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        n = min(len(old), len(new)) // bt * bt
        naive = 0
        while naive < n // bt and old[naive * bt:(naive + 1) * bt] == new[naive * bt:(naive + 1) * bt]:
            naive += 1
        assert shared_blocks(old, new, n, bt) == naive


def test_joined_tokens_read_like_the_concatenated_list():
    """A view job's history is its prompt joined to its generated tokens, not
    copied: lengths, indexes and slices (all block hashing reads) equal the
    concatenated list's, and tokens the tail gains later show."""
    head, tail = list(range(100, 170)), [7, 8, 9]
    joined = JoinedTokens(head, tail)
    whole = head + tail
    assert len(joined) == len(whole) and list(joined) == whole
    for s in (slice(0, 32), slice(64, 73), slice(70, 73), slice(60, 200), slice(None), slice(-5, None),
              slice(3, 60, 7), slice(71, 10)):
        assert joined[s] == whole[s], s
    assert [joined[i] for i in range(-len(whole), len(whole))] == whole + whole
    with pytest.raises(IndexError):
        joined[len(whole)]
    tail.append(10)  # vLLM appends to a request's output tokens in place
    assert len(joined) == len(whole) + 1 and joined[-1] == 10
    hashes = extend_block_hashes([], joined, 32, "s")
    assert hashes == extend_block_hashes([], head + tail, 32, "s")


def test_the_memo_stays_bounded_whatever_clients_send():
    """Prompts shorter than a block leave nothing to reuse and take no entry;
    many sessions never hold more than `max_entries`."""
    from vllm_sekv.workspace.hashing import PrefixHashMemo

    memo = PrefixHashMemo(8, capacity_tokens=1 << 20, max_entries=16)
    for i in range(1000):
        memo.hashes([1, 2, 3], "t", f"id-{i}")
    assert len(memo) == 0
    for i in range(1000):
        memo.hashes(list(range(16)), "t", f"id-{i}")
    assert len(memo) == 16


def test_the_memo_keeps_its_own_tokens_when_a_sequence_grows():
    memo = PrefixHashMemo(block_tokens=4)
    tokens = list(range(16))
    memo.hashes(tokens, "s")
    grown = tokens + list(range(100, 108))
    memo.hashes(grown, "s")
    grown[2], tokens[3] = 999, 998  # callers rewrite their lists
    again = list(range(16)) + list(range(100, 108)) + [1, 2, 3, 4]
    assert memo.hashes(again, "s") == extend_block_hashes([], again, 4, "s")
    assert memo.hashes(grown, "s") == extend_block_hashes([], grown, 4, "s")
