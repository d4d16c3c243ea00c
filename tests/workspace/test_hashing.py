from vllm_sekv.workspace.hashing import extend_block_hashes


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
