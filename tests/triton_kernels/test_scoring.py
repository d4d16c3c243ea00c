"""Mean-K scoring: reference against a float64 formula (CPU), Triton kernel against
the reference (GPU), and top-k selection with forced sink/recent blocks."""
import math

import pytest
import torch

from vllm_sekv.triton_kernels.scoring import reference, select_blocks



def _float64_scores(queries, index, num_blocks, combine):
    """Direct, loop-free restatement of the formula in float64."""
    num_layers, q_heads, _, head_dim = queries.shape
    group = q_heads // index.shape[2]
    k = index[:num_blocks].double().repeat_interleave(group, dim=2)  # [B, L, Hq, D]
    logits = torch.einsum("lhtd,blhd->lhtb", queries.double(), k) / math.sqrt(head_dim)
    per_head = torch.softmax(logits, dim=-1).sum(dim=2).reshape(num_layers * q_heads, num_blocks)
    return per_head.mean(0) if combine == "mean" else per_head.amax(0)


SHAPES = [  # layers, q_heads, kv_heads, tokens, capacity, valid blocks, head_dim
    pytest.param(2, 4, 2, 5, 9, 7, 16, id="L2-gqa2-T5-B7of9-D16"),
    pytest.param(3, 6, 1, 17, 40, 40, 32, id="L3-mqa-T17-B40-D32"),
    pytest.param(1, 2, 2, 1, 3, 1, 8, id="L1-mha-T1-B1-D8"),
]


@pytest.mark.parametrize("combine", ["mean", "max"])
@pytest.mark.parametrize("layers,q_heads,kv_heads,tokens,capacity,valid,head_dim", SHAPES)
def test_reference_matches_float64_formula(layers, q_heads, kv_heads, tokens, capacity, valid, head_dim, combine):
    gen = torch.Generator().manual_seed(layers * 100 + tokens)
    q = torch.randn(layers, q_heads, tokens, head_dim, generator=gen)
    index = torch.randn(capacity, layers, kv_heads, head_dim, generator=gen)
    index[valid:] = 1e4  # garbage past the valid count must not matter
    got = reference.score_blocks(q, index, valid, combine)
    want = _float64_scores(q, index, valid, combine)
    assert got.dtype == torch.float32 and got.shape == (valid,)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    if combine == "mean":  # each (layer, head, token) distributes mass 1
        assert got.sum().item() == pytest.approx(tokens, rel=1e-5)


def test_reference_rejects_bad_shapes():
    q = torch.randn(2, 3, 4, 8)
    with pytest.raises(ValueError, match="multiple"):
        reference.score_blocks(q, torch.randn(5, 2, 2, 8))
    with pytest.raises(ValueError, match="combine"):
        reference.score_blocks(q, torch.randn(5, 2, 1, 8), combine="sum")
    with pytest.raises(ValueError, match="num_blocks"):
        reference.score_blocks(q, torch.randn(5, 2, 1, 8), num_blocks=6)
    assert reference.score_blocks(q, torch.randn(5, 2, 1, 8), num_blocks=0).shape == (0,)


@pytest.mark.parametrize("scores,k,sink,recent,want", [
    pytest.param([0.1, 0.9, 0.2, 0.8, 0.3, 0.0], 2, 1, 1, [0, 1, 3, 5], id="basic"),
    pytest.param([0.1, 0.9, 0.2, 0.8, 0.3, 0.0], 10, 1, 1, [0, 1, 2, 3, 4, 5], id="k-exceeds-candidates"),
    pytest.param([5.0, 0.1, 0.2], 1, 0, 0, [0], id="no-forced"),
    pytest.param([0.5, 0.5, 0.5, 0.5], 2, 0, 0, [0, 1], id="ties-to-lower-id"),
    pytest.param([0.0, 9.0, 9.0], 1, 2, 2, [0, 1, 2], id="sink-recent-overlap"),
    pytest.param([], 3, 1, 1, [], id="empty"),
])
def test_select_blocks(scores, k, sink, recent, want):
    got = select_blocks(torch.tensor(scores, dtype=torch.float32), k, sink, recent)
    assert got.tolist() == want


def test_select_blocks_candidate_range():
    scores = torch.tensor([0.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.1])
    got = select_blocks(scores, 2, sink_blocks=1, recent_blocks=1, candidate_start=3, candidate_end=6)
    assert got.tolist() == [0, 3, 4, 6]


GPU_SHAPES = [
    pytest.param(3, 8, 2, 37, 301, 257, 128, id="L3-gqa4-T37-B257of301-D128"),
    pytest.param(2, 4, 4, 130, 67, 67, 64, id="L2-mha-T130-B67-D64"),
    pytest.param(1, 6, 2, 5, 1000, 999, 96, id="L1-gqa3-T5-B999-D96"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("combine", ["mean", "max"])
@pytest.mark.parametrize("layers,q_heads,kv_heads,tokens,capacity,valid,head_dim", GPU_SHAPES)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_matches_reference(layers, q_heads, kv_heads, tokens, capacity, valid, head_dim, combine, dtype):
    from vllm_sekv.triton_kernels.scoring import kernel

    q = (torch.randn(layers, q_heads, tokens, head_dim, device="cuda") * 2).to(dtype)
    index = torch.randn(capacity, layers, kv_heads, head_dim, device="cuda").to(dtype)
    index[valid:] = float("nan")  # never read past num_blocks
    got = kernel.score_blocks(q, index, valid, combine)
    want = reference.score_blocks(q, index, valid, combine)
    assert torch.isfinite(got).all()
    # Same bf16/fp16 inputs, fp32 accumulation on both sides: only summation order
    # and exp2 rounding differ.
    torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-4 * tokens)



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fast_exp_option_stays_close_to_reference():
    from vllm_sekv.triton_kernels.scoring import kernel

    q = torch.randn(2, 8, 64, 128, device="cuda").to(torch.bfloat16)
    index = torch.randn(513, 2, 2, 128, device="cuda").to(torch.bfloat16)
    fast = kernel.ScoringConfig(fast_exp=True)
    for combine in ("max", "mean"):
        got = kernel.score_blocks(q, index, None, combine, fast)
        want = reference.score_blocks(q, index, None, combine)
        # fp16 exp2 per term: ~1e-3 relative per probability, averaged over tokens.
        assert ((got - want).norm() / want.norm()).item() < 1e-2
