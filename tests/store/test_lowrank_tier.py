import numpy as np
import pytest
import torch

from vllm_sekv.ops import RopeSpec, rotate_keys
from vllm_sekv.store import HostPool
from vllm_sekv.store.codecs import ExactCodec, LowRankCodec
from vllm_sekv.store.lowrank_tier import LowRankTier

L, T, H, D = 3, 16, 2, 8  # layers, block_tokens, kv_heads, head_dim
DTYPES = [torch.bfloat16, torch.float32]
BITS = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
FULL_RANK = D  # >= head_dim: every piece is stored exact (codec fallback)


def rope(base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    return RopeSpec(inv_freq=inv, rotary_dim=D)


def fill_block(pool, slot, start, seed=0, pre=None):
    """Write random (or given `pre` [L, T, H, D]) pre-RoPE keys rotated to virtual
    positions start..start+T, and random values, into `slot`; returns (pre, values)."""
    g = torch.Generator().manual_seed(seed)
    if pre is None:
        pre = torch.randn(L, T, H, D, generator=g)
    values = torch.randn(L, T, H, D, generator=g)
    positions = torch.arange(start, start + T)
    for layer in range(L):
        pool.data[slot, 0, layer] = rotate_keys(pre[layer], positions, rope()).to(pool.data.dtype)
    pool.data[slot, 1] = values.to(pool.data.dtype)
    return pre, values


def make(dtype=torch.float32, rank=FULL_RANK, slots=4):
    return HostPool(slots, L, T, H, D, dtype), LowRankTier(LowRankCodec(rank), T, rope())


def reference_keys(pool, slot, start, offsets, positions):
    """Pool keys de-rotated from start+offset and rotated to `positions` the way the
    tier does it: float32 rotations, pool dtype in between and at the end."""
    dtype = pool.data.dtype
    offsets = torch.as_tensor(offsets)
    out = []
    for layer in range(L):
        k = pool.data[slot, 0, layer, offsets].float()
        pre = rotate_keys(k, -(start + offsets), rope()).to(dtype)
        out.append(rotate_keys(pre.float(), torch.as_tensor(positions), rope()).to(dtype))
    return torch.stack(out)


def same_bits(a, b):
    return a.dtype == b.dtype and torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


def rel_err(x_hat, x):
    return float((x_hat.float() - x.float()).norm() / x.float().norm())


# ---------------------------------------------------------------- 1. full rank


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_full_rank_round_trip(dtype):
    pool, tier = make(dtype)
    start = 4096
    fill_block(pool, 2, start)
    tier.encode_block(pool, 2, start)
    offsets = torch.arange(T)
    positions = torch.randint(0, 10000, (T,), generator=torch.Generator().manual_seed(1))
    keys, values, moved = tier.decode_rows(2 * T + offsets, positions)
    assert keys.shape == values.shape == (L, T, H, D)
    assert keys.dtype == values.dtype == dtype and keys.device.type == "cpu"
    assert same_bits(values, pool.data[2, 1].contiguous())
    # Bit-identical to de-rotating then rotating the pool keys the same way ...
    assert same_bits(keys, reference_keys(pool, 2, start, offsets, positions))
    # ... and close to one direct rotation of the pool keys by (position - virtual position).
    direct = torch.stack([rotate_keys(pool.data[2, 0, layer].float(), positions - (start + offsets), rope())
                          for layer in range(L)])
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the pre-RoPE key is rounded once more
    torch.testing.assert_close(keys.float(), direct, rtol=tol, atol=tol)
    assert moved == tier.encoded_bytes(2) == tier.exact_bytes() == pool.block_bytes


def test_encoding_is_a_copy_of_the_pool():
    pool, tier = make()
    fill_block(pool, 0, 0)
    before = pool.data[0].clone()
    tier.encode_block(pool, 0, 0)
    assert torch.equal(pool.data[0], before)  # the pool is never written
    pool.data[0] = 0.0
    keys, values, _ = tier.decode_rows(np.arange(T), np.arange(T))
    assert torch.equal(values, before[1])
    torch.testing.assert_close(keys, before[0], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- 2. rank vs error and bytes


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_error_falls_and_bytes_grow_with_rank(dtype):
    start = 300
    errs, sizes = [], []
    for rank in (1, 2, 4):
        pool, tier = make(dtype, rank)
        pre, values = fill_block(pool, 1, start, seed=7)
        tier.encode_block(pool, 1, start)
        # position 0 is the identity rotation: the keys come back pre-RoPE
        keys, vals, moved = tier.decode_rows(T + np.arange(T), np.zeros(T, dtype=np.int64))
        errs.append((rel_err(keys, pre), rel_err(vals, values)))
        sizes.append(tier.encoded_bytes(1))
        assert moved == sizes[-1] == L * LowRankCodec(rank).bytes_for(T, H, D, dtype)
        assert sizes[-1] < tier.exact_bytes()
    for (k_lo, v_lo), (k_hi, v_hi) in zip(errs[1:], errs[:-1]):
        assert k_lo < k_hi and v_lo < v_hi
    assert 0.0 < errs[-1][0] < 1.0 and 0.0 < errs[-1][1] < 1.0
    assert sizes == sorted(sizes) and len(set(sizes)) == 3


# ---------------------------------------------------------------- 3. pieces


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pieces_at_full_rank_are_exact(dtype):
    pool, tier = make(dtype)
    pieces = [(0, 3), (3, 10), (10, 11), (11, 16)]
    start = 77
    fill_block(pool, 3, start, seed=3)
    tier.encode_block(pool, 3, start, pieces)
    offsets = torch.arange(T).flip(0)
    positions = torch.arange(T) * 5
    keys, values, moved = tier.decode_rows(3 * T + offsets, positions)
    assert same_bits(values, pool.data[3, 1, :, offsets])
    assert same_bits(keys, reference_keys(pool, 3, start, offsets, positions))
    assert moved == tier.exact_bytes()


def test_pieces_are_factored_separately():
    """Two pieces, each a different rank-1 matrix per head: rank 1 per piece is
    (almost) exact, rank 1 over the whole block is not."""
    g = torch.Generator().manual_seed(5)
    half = T // 2
    pre = torch.cat([torch.randn(L, 1, H, D, generator=g) * torch.randn(L, half, H, 1, generator=g)
                     for _ in range(2)], dim=1)
    errs = {}
    for name, pieces in (("two", [(0, half), (half, T)]), ("one", None)):
        pool, tier = make(torch.float32, rank=1)
        fill_block(pool, 0, 1000, pre=pre)
        tier.encode_block(pool, 0, 1000, pieces)
        keys, _, _ = tier.decode_rows(np.arange(T), np.zeros(T, dtype=np.int64))
        errs[name] = rel_err(keys, pre)
    assert errs["two"] < 1e-5 < 0.1 < errs["one"]


def test_short_piece_is_exact_next_to_a_factored_one():
    pool, tier = make(torch.bfloat16, rank=2)
    fill_block(pool, 0, 50)
    tier.encode_block(pool, 0, 50, [(0, 1), (1, T)])  # 1 token < rank: stored exact
    keys, values, moved = tier.decode_rows(np.array([0, 5]), np.array([50, 55]))
    assert same_bits(values[:, :1], pool.data[0, 1, :, :1])
    assert not torch.equal(values[:, 1:], pool.data[0, 1, :, 5:6])
    assert same_bits(keys[:, :1], reference_keys(pool, 0, 50, [0], [50]))
    codec = LowRankCodec(2)
    assert moved == L * (codec.bytes_for(1, H, D, torch.bfloat16) + codec.bytes_for(T - 1, H, D, torch.bfloat16))


@pytest.mark.parametrize("pieces", [
    [], [(0, 8)], [(0, 8), (9, 16)], [(0, 8), (7, 16)], [(0, 0), (0, 16)], [(0, 17)],
    [(-1, 16)], [(8, 16), (0, 8)], [(0, 16.0)], [(0, 8, 16)], [(4, 16)],
])
def test_bad_pieces_raise(pieces):
    pool, tier = make()
    with pytest.raises(ValueError, match="pieces"):
        tier.encode_block(pool, 0, 0, pieces)
    assert not tier.has(0)


def test_bad_arguments_raise():
    pool, tier = make()
    with pytest.raises(ValueError, match="codec"):
        LowRankTier(ExactCodec(), T, rope())
    with pytest.raises(ValueError, match="block_tokens"):
        LowRankTier(LowRankCodec(2), 0, rope())
    with pytest.raises(ValueError, match="slot"):
        tier.encode_block(pool, 4, 0)
    with pytest.raises(ValueError, match="start_token"):
        tier.encode_block(pool, 0, -1)
    with pytest.raises(ValueError, match="block_tokens"):
        tier.encode_block(HostPool(1, L, T // 2, H, D, torch.float32), 0, 0)
    with pytest.raises(ValueError, match="encoded"):
        tier.exact_bytes()
    tier.encode_block(pool, 0, 0)
    with pytest.raises(ValueError, match="layout"):
        tier.encode_block(HostPool(1, L, T, H, D, torch.bfloat16), 0, 0)
    with pytest.raises(ValueError, match="positions"):
        tier.decode_rows(np.arange(3), np.arange(4))
    with pytest.raises(ValueError, match="rows"):
        tier.decode_rows(np.array([0.5]), np.array([0]))
    pool.data[1, 1, 0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        LowRankTier(LowRankCodec(1), T, rope()).encode_block(pool, 1, 0)


# ---------------------------------------------------------------- 4. rows from several slots


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_from_two_slots_in_any_order(dtype):
    pool, tier = make(dtype)
    fill_block(pool, 1, 0, seed=1)
    fill_block(pool, 3, 5 * T, seed=2)
    tier.encode_block(pool, 1, 0, [(0, 4), (4, 16)])
    tier.encode_block(pool, 3, 5 * T)
    offsets = np.array([9, 2, 9, 15, 6, 5])   # slot 1's offsets 9, 15, 5: only its piece 1
    slots = np.array([3, 3, 1, 1, 3, 1])
    rows = torch.from_numpy(slots * T + offsets)
    positions = torch.tensor([7, 0, 123, 2, 90000, 40])
    keys, values, moved = tier.decode_rows(rows, positions, device="cpu")
    assert keys.shape == (L, 6, H, D)
    start = {1: 0, 3: 5 * T}
    for i, (s, o) in enumerate(zip(slots.tolist(), offsets.tolist())):
        assert same_bits(values[:, i], pool.data[s, 1, :, o])
        ref = reference_keys(pool, s, start[s], [o], positions[i:i + 1])
        assert same_bits(keys[:, i:i + 1], ref)
    per_token = 2 * L * H * D * torch.empty((), dtype=dtype).element_size()
    assert moved == (12 + T) * per_token  # slot 1 piece [4, 16) once + slot 3 whole block once


def test_missing_slot_and_empty_rows():
    pool, tier = make()
    with pytest.raises(ValueError, match="encoded"):
        tier.decode_rows(np.array([0]), np.array([0]))
    fill_block(pool, 0, 0)
    tier.encode_block(pool, 0, 0)
    with pytest.raises(ValueError, match="slot 2"):
        tier.decode_rows(np.array([1, 2 * T + 3]), np.array([0, 0]))
    keys, values, moved = tier.decode_rows(np.array([], dtype=np.int64), np.array([], dtype=np.int64))
    assert keys.shape == values.shape == (L, 0, H, D) and moved == 0


# ---------------------------------------------------------------- 5. drop / has / re-encode


def test_drop_has_and_reencode_replaces():
    pool, tier = make(rank=2)
    assert not tier.has(1)
    tier.drop(1)  # absent: no error
    fill_block(pool, 1, 0, seed=1)
    tier.encode_block(pool, 1, 0)
    assert tier.has(1) and not tier.has(0)
    whole_bytes = tier.encoded_bytes(1)

    old_values = pool.data[1, 1].clone()
    fill_block(pool, 1, 10 * T, seed=2)  # the slot is reused by another block
    tier.encode_block(pool, 1, 10 * T, [(0, 1), (1, T)])
    assert tier.encoded_bytes(1) != whole_bytes
    _, values, _ = tier.decode_rows(T + np.arange(1), np.zeros(1, dtype=np.int64))
    assert torch.equal(values[:, 0], pool.data[1, 1, :, 0])  # the exact 1-token piece of the new block
    assert not torch.equal(values[:, 0], old_values[:, 0])

    tier.drop(1)
    assert not tier.has(1)
    with pytest.raises(ValueError, match="slot 1"):
        tier.encoded_bytes(1)
    with pytest.raises(ValueError, match="slot 1"):
        tier.decode_rows(np.array([T]), np.array([0]))
