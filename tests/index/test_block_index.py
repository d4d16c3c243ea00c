import math

import pytest
import torch

from vllm_sekv.ops import RopeSpec, rotate_keys
from vllm_sekv.store import HostPool
from vllm_sekv.index import block_summaries as summaries
from vllm_sekv.index.block_index import BlockIndex


def rope(head_dim=16, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return RopeSpec(inv_freq=inv, rotary_dim=head_dim)


def pool_with_block(start, L=3, T=8, H=2, D=16, seed=0):
    g = torch.Generator().manual_seed(seed + start)
    spec = rope(D)
    pool = HostPool(4, L, T, H, D, torch.float32)
    pre = torch.randn(L, T, H, D, generator=g)
    positions = torch.arange(start, start + T)
    for layer in range(L):  # store post-RoPE keys, as captured from the model
        pool.data[2, 0, layer] = rotate_keys(pre[layer], positions, spec)
    return pool, pre, spec


@pytest.mark.parametrize("start", [0, 96, 5000])
def test_mean_pre_entry_is_the_mean_pre_rope_key(start):
    pool, pre, spec = pool_with_block(start)
    index = BlockIndex(4, 3, 2, 16, spec, kind="mean_pre", dtype=torch.float32)
    index.add(pool, slot=2, start_token=start)
    assert index.valid[2] and not index.valid[0]
    torch.testing.assert_close(index.entries[2, :, 0], pre.mean(dim=1), atol=1e-5, rtol=1e-5)


def test_sub_block_entries_and_score_match_a_direct_computation():
    start = 160
    pool, pre, spec = pool_with_block(start)
    index = BlockIndex(4, 3, 2, 16, spec, kind="sub4_pre", dtype=torch.float32)
    index.add(pool, slot=2, start_token=start)
    # sub4 on an 8-token block: eight vectors, each the mean of one token here.
    torch.testing.assert_close(index.entries[2].transpose(0, 1), pre.transpose(0, 1),
                               atol=1e-5, rtol=1e-5)
    pool.data[1] = pool.data[2]
    index.add(pool, slot=1, start_token=start)  # the same block twice: equal scores
    q = torch.randn(5, 4, 16)  # 4 query heads over 2 KV heads
    got = index.score(1, q, torch.tensor([1, 2, 0]))
    want = summaries.score_per_head("sub4_pre", q, index.entries[[1, 2], 1].float())
    torch.testing.assert_close(got[:, :2], want)
    assert torch.all(got[:, 2] == 0)  # slot 0 was never indexed: no part in the softmax
    torch.testing.assert_close(got[:, 0], got[:, 1])
    torch.testing.assert_close(got.sum(-1), torch.full((4,), 5.0))
    assert torch.all(index.score(1, q, torch.tensor([0, 3])) == 0)  # none indexed: all 0


@pytest.mark.parametrize("start", [0, 96])
def test_anchor_entry_is_the_highest_surprisal_tokens_pre_rope_key(start):
    pool, pre, spec = pool_with_block(start)
    index = BlockIndex(4, 3, 2, 16, spec, kind="anchor_pre", dtype=torch.float32)
    surprisal = torch.tensor([[0.5, 1.0, float("nan"), 7.5, 2.0, 0.1, 3.0, 0.0]])  # token 3 is the anchor
    index.add_many(pool, [2], [start], surprisal)
    torch.testing.assert_close(index.entries[2, :, 0], pre.mean(dim=1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(index.entries[2, :, 1], pre[:, 3], atol=1e-5, rtol=1e-5)
    index.add_many(pool, [2], [start], torch.full((1, 8), float("nan")))  # unknown: first token
    torch.testing.assert_close(index.entries[2, :, 1], pre[:, 0], atol=1e-5, rtol=1e-5)


def test_rotation_composes_and_inverts():
    spec = rope(16)
    x = torch.randn(5, 2, 16, dtype=torch.float32)
    p = torch.tensor([0, 1, 17, 1000, 65000])
    there = rotate_keys(x, p, spec)
    assert not torch.allclose(there[1:], x[1:])
    torch.testing.assert_close(rotate_keys(there, -p, spec), x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rotate_keys(rotate_keys(x, p, spec), p, spec), rotate_keys(x, 2 * p, spec),
                               atol=1e-4, rtol=1e-4)
    # the norm is preserved: a pure rotation
    torch.testing.assert_close(there.norm(dim=-1), x.norm(dim=-1), atol=1e-5, rtol=1e-5)
    assert math.isclose(float(spec.inv_freq[0]), 1.0)


def test_add_many_equals_one_by_one():
    g = torch.Generator().manual_seed(3)
    spec = rope(16)
    pool = HostPool(6, 3, 8, 2, 16, torch.float32)
    pool.data.copy_(torch.randn(pool.data.shape, generator=g))
    one = BlockIndex(6, 3, 2, 16, spec, kind="sub4_pre", dtype=torch.float32)
    many = BlockIndex(6, 3, 2, 16, spec, kind="sub4_pre", dtype=torch.float32)
    slots, starts = [4, 1, 3], [0, 800, 64]
    for slot, start in zip(slots, starts):
        one.add(pool, slot, start)
    many.add_many(pool, slots, starts, chunk=2)
    torch.testing.assert_close(many.entries, one.entries)
    assert torch.equal(many.valid, one.valid)
