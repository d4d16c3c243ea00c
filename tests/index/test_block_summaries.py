"""Block summaries and scoring (vllm_sekv.index.block_summaries) against direct computations."""

import math

import pytest
import torch

from vllm_sekv.index import block_summaries as S

BT, H, HQ, D = 32, 2, 6, 16          # block tokens, KV heads, query heads, head_dim (GQA 3:1)


@pytest.fixture
def keys():
    g = torch.Generator().manual_seed(0)
    kp = torch.randn(5 * BT, H, D, generator=g)
    kq = torch.randn(5 * BT, H, D, generator=g)
    w = S.surprisal_weights(torch.rand(5 * BT, generator=g) * 5, BT)
    return kp, kq, w


def _kv_head(h):
    return h // (HQ // H)


def test_registry_has_required_kinds_and_default():
    for name in ("mean_pre", "mean_post", "minmax_post", S.DEFAULT_SUMMARY):
        assert name in S.SUMMARY_KINDS
    S.combine_heads(torch.rand(3, 4), S.DEFAULT_COMBINE)   # a valid combine
    with pytest.raises(ValueError):
        S.get_kind("nope")


@pytest.mark.parametrize("name", sorted(S.SUMMARY_KINDS))
def test_summary_shapes_and_key_space(name, keys):
    kp, kq, w = keys
    kind = S.get_kind(name)
    out = S.summarize_blocks(name, kp, kq, w, BT)
    assert out.shape == (5, kind.vectors_per_block, H, D)
    # a pre kind must not look at post keys, and vice versa
    if kind.query_space == "pre":
        other = S.summarize_blocks(name, kp, kq + 100.0, w, BT)
    else:
        other = S.summarize_blocks(name, kp + 100.0, kq, w, BT)
    torch.testing.assert_close(out, other)


def test_means_match_direct(keys):
    kp, kq, w = keys
    blk = kp.reshape(5, BT, H, D)
    torch.testing.assert_close(S.summarize_blocks("mean_pre", kp, kq, None, BT)[:, 0], blk.mean(1))
    torch.testing.assert_close(S.summarize_blocks("mean_post", kp, kq, None, BT)[:, 0],
                               kq.reshape(5, BT, H, D).mean(1))
    wb = w.reshape(5, BT)
    direct = (blk * wb[..., None, None]).sum(1)
    torch.testing.assert_close(S.summarize_blocks("wmean_pre", kp, kq, w, BT)[:, 0], direct)
    sub = S.summarize_blocks("sub8_pre", kp, kq, None, BT)
    torch.testing.assert_close(sub[2, 1], blk[2, 8:16].mean(0))
    out = S.summarize_blocks("outlier_pre", kp, kq, None, BT)
    far = (blk[1, :, 1] - blk[1, :, 1].mean(0)).norm(dim=-1).argmax()
    torch.testing.assert_close(out[1, 1, 1], blk[1, far, 1])
    torch.testing.assert_close(out[:, 0], blk.mean(1))
    anc = S.summarize_blocks("anchor_pre", kp, kq, w, BT)
    torch.testing.assert_close(anc[3, 1], blk[3, int(wb[3].argmax())])


def test_surprisal_weights_sum_to_one_per_block():
    h = torch.tensor([1.0, 3.0, 0.0, 0.0] + [0.0] * 4)
    w = S.surprisal_weights(h, 4)
    torch.testing.assert_close(w, torch.tensor([0.25, 0.75, 0.0, 0.0, 0.25, 0.25, 0.25, 0.25]))
    with pytest.raises(ValueError):
        S.surprisal_weights(torch.ones(5), 4)


def test_mean_logits_match_direct_gqa(keys):
    kp, kq, w = keys
    q = torch.randn(7, HQ, D)
    summ = S.summarize_blocks("mean_pre", kp, kq, None, BT)
    got = S.block_logits("mean_pre", q, summ)                       # [7, HQ, 5]
    for h in range(HQ):
        direct = q[:, h] @ summ[:, 0, _kv_head(h)].T / math.sqrt(D)
        torch.testing.assert_close(got[:, h], direct)


def test_multi_vector_logits_are_logsumexp(keys):
    kp, kq, w = keys
    q = torch.randn(3, HQ, D)
    summ = S.summarize_blocks("sub8_pre", kp, kq, None, BT)
    got = S.block_logits("sub8_pre", q, summ)
    h = 4
    dots = torch.einsum("md,bsd->mbs", q[:, h], summ[:, :, _kv_head(h)]) / math.sqrt(D)
    torch.testing.assert_close(got[:, h], torch.logsumexp(dots, -1))


def test_minmax_is_upper_bound_of_true_max(keys):
    kp, kq, w = keys
    q = torch.randn(50, HQ, D)
    summ = S.summarize_blocks("minmax_post", kp, kq, None, BT)
    bound = S.block_logits("minmax_post", q, summ)                  # [50, HQ, 5]
    blk = kq.reshape(5, BT, H, D)
    for h in range(HQ):
        true_max = torch.einsum("md,btd->mbt", q[:, h], blk[:, :, _kv_head(h)]).amax(-1) / math.sqrt(D)
        assert (bound[:, h] >= true_max - 1e-5).all()
    # and it is tight for a block of one repeated key
    rep = kq[:1].expand(BT, H, D).contiguous()
    s1 = S.summarize_blocks("minmax_post", rep, rep, None, BT)
    torch.testing.assert_close(S.block_logits("minmax_post", q, s1)[..., 0],
                               torch.einsum("mgrd,gd->mgr", q.reshape(50, H, HQ // H, D),
                                            rep[0]).reshape(50, HQ) / math.sqrt(D))


@pytest.mark.parametrize("name", sorted(S.SUMMARY_KINDS))
def test_block_matching_query_ranks_first(name):
    g = torch.Generator().manual_seed(1)
    L, B = 2, 12
    kp = torch.randn(L, B * BT, H, D, generator=g) * 0.3
    target = torch.randn(H, D, generator=g)
    target = 4 * target / target.norm(dim=-1, keepdim=True)
    kp[:, 7 * BT:8 * BT] = target                                  # block 7 = the query's direction
    w = S.surprisal_weights(torch.rand(B * BT, generator=g), BT)
    summ = torch.stack([S.summarize_blocks(name, kp[l], kp[l], w, BT) for l in range(L)])
    q = target.repeat_interleave(HQ // H, 0)[None, None].expand(L, 3, HQ, D) * 2
    for combine in ("mean", "max", "top4"):
        r = S.score(name, q, summ, combine)
        assert r.shape == (B,)
        assert int(r.argmax()) == 7, combine


def test_score_per_head_and_combine_match_direct(keys):
    kp, kq, w = keys
    L = 3
    summ = torch.stack([S.summarize_blocks("mean_post", kp * (l + 1), kq * (l + 1), None, BT)
                        for l in range(L)])
    q = torch.randn(L, 4, HQ, D)
    per = S.score_per_head("mean_post", q, summ)
    assert per.shape == (L, HQ, 5)
    direct = torch.softmax(torch.einsum("lmhd,lbhd->lhmb", q,
                                        summ[:, :, 0].repeat_interleave(HQ // H, 2)) / math.sqrt(D), -1).sum(2)
    torch.testing.assert_close(per, direct)
    torch.testing.assert_close(per.sum(-1), torch.full((L, HQ), 4.0))   # softmax over blocks per token
    torch.testing.assert_close(S.score("mean_post", q, summ, "mean"), direct.mean((0, 1)))
    torch.testing.assert_close(S.score("mean_post", q, summ, "max"), direct.amax((0, 1)))
    flat = direct.reshape(L * HQ, 5)
    top3 = torch.stack([flat[:, b].sort(descending=True).values[:3].mean() for b in range(5)])
    torch.testing.assert_close(S.score("mean_post", q, summ, "top3"), top3)
    torch.testing.assert_close(S.combine_heads(per, "top1"), S.combine_heads(per, "max"))
    torch.testing.assert_close(S.combine_heads(per, f"top{L * HQ}"), S.combine_heads(per, "mean"))
    with pytest.raises(ValueError):
        S.combine_heads(per, "median")
    with pytest.raises(ValueError):
        S.combine_heads(per, "top0")


def test_select_blocks_forces_and_ranks():
    r = torch.tensor([9.0, 1.0, 5.0, 3.0, 7.0, 2.0, 8.0])
    assert S.select_blocks(r, 2, forced=[0, 6]).tolist() == [0, 2, 4, 6]
    assert S.select_blocks(r, 0, forced=[3]).tolist() == [3]
    assert S.select_blocks(r, 99).tolist() == list(range(7))
    with pytest.raises(ValueError):
        S.select_blocks(r, 1, forced=[7])


def test_select_blocks_interleaves_two_rankings():
    pos = torch.tensor([0.0, 1, 2, 3, 4, 5, 6, 7])      # prefers late blocks
    content = torch.tensor([9.0, 8, 7, 1, 1, 1, 1, 6])   # prefers early blocks and 7
    # forced 0; content's best free is 1, position's best free is 7, then 2 and 6
    assert S.select_blocks([pos, content], 4, forced=[0]).tolist() == [0, 1, 2, 6, 7]
    # a block both want is taken once and the budget is still filled
    assert len(S.select_blocks([pos, pos], 3)) == 3
    with pytest.raises(ValueError):
        S.select_blocks([pos, content[:5]], 2)


def test_shape_errors(keys):
    kp, kq, w = keys
    with pytest.raises(ValueError):
        S.summarize_blocks("mean_pre", kp[:-1], kq[:-1], None, BT)
    with pytest.raises(ValueError):
        S.summarize_blocks("wmean_pre", kp, kq, None, BT)
    summ = S.summarize_blocks("mean_pre", kp, kq, None, BT)
    with pytest.raises(ValueError):
        S.block_logits("mean_pre", torch.randn(2, 5, D), summ)   # 5 query heads vs 2 KV heads
