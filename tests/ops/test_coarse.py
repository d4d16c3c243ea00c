"""SeKV coarse-attention merge: the reference against exact attention (CPU, float64),
with summaries built by the workspace's segmentation and segment summaries, and
the Triton kernel against the reference (GPU)."""

import pytest
import torch

from vllm_sekv.ops.coarse import coarse_reference as ref
from vllm_sekv.workspace.segment_summaries import summarize_segments
from vllm_sekv.workspace.segments import segment

F64 = torch.float64


def _scenario(seed, q_heads, kv_heads, num_tokens=160, num_q=9, head_dim=16):
    """A session of `num_tokens` tokens cut into segments; about half of them
    expanded. Every non-expanded segment's summarized tokens (all but its anchor)
    share one key and one value, so its summary is exact."""
    g = torch.Generator().manual_seed(seed)
    h = torch.distributions.Gamma(1.2, 0.4).sample((num_tokens,)).double()
    segs = segment(h, alpha=1.0, max_segment_tokens=12)
    keys = torch.randn(num_tokens, kv_heads, head_dim, generator=g, dtype=F64)
    values = torch.randn(num_tokens, kv_heads, head_dim, generator=g, dtype=F64)
    expanded = torch.rand(segs.num_segments, generator=g) < 0.5
    expanded[:2] = torch.tensor([True, False])
    in_view = torch.zeros(num_tokens, dtype=torch.bool)
    in_view[segs.anchors] = True
    for s in range(segs.num_segments):
        lo, hi = int(segs.starts[s]), int(segs.ends[s])
        if expanded[s]:
            in_view[lo:hi] = True
        else:
            lo += int(segs.is_anchor[s])
            keys[lo:hi] = torch.randn(kv_heads, head_dim, generator=g, dtype=F64)
            values[lo:hi] = torch.randn(kv_heads, head_dim, generator=g, dtype=F64)
    rest = segs.take(~expanded)
    summ = summarize_segments(keys, values, h, rest)
    q = torch.randn(num_q, q_heads, head_dim, generator=g, dtype=F64) * 1.5
    assert 0 < int(in_view.sum()) < num_tokens and rest.num_segments > 2
    return dict(g=g, keys=keys, values=values, in_view=in_view, rest=rest, summ=summ, q=q)


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (6, 2)], ids=["mha", "gqa3"])
@pytest.mark.parametrize("seed", range(3))
def test_merge_of_exact_summaries_equals_full_attention(seed, q_heads, kv_heads):
    sc = _scenario(seed, q_heads, kv_heads)
    q, keys, values, in_view, rest, summ = (sc[k] for k in ("q", "keys", "values", "in_view", "rest", "summ"))
    want_out, want_lse = ref.attention_with_lse(q, keys, values)
    out_view, lse_view = ref.attention_with_lse(q, keys[in_view], values[in_view])
    out, lse = ref.coarse_merge(q, out_view, lse_view, summ.keys, summ.values, summ.num_tokens)
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, want_lse, rtol=1e-10, atol=1e-10)
    # not vacuous: the view alone is far from the full attention
    assert (out_view - want_out).abs().max() > 1e-2


@pytest.mark.parametrize("q_heads,kv_heads", [(3, 1), (6, 2)], ids=["mqa", "gqa3"])
@pytest.mark.parametrize("seed", range(3))
def test_merge_with_visibility_mask_equals_masked_full_attention(seed, q_heads, kv_heads):
    sc = _scenario(10 + seed, q_heads, kv_heads)
    q, keys, values, in_view, rest, summ, g = (sc[k] for k in ("q", "keys", "values", "in_view", "rest", "summ", "g"))
    num_q, num_tokens, num_sum = q.shape[0], keys.shape[0], rest.num_segments
    view_mask = torch.rand(num_q, num_tokens, generator=g) < 0.7
    seg_mask = torch.rand(num_q, num_sum, generator=g) < 0.6
    view_mask[0], seg_mask[0] = False, False       # sees nothing
    view_mask[1] = False                            # sees only summaries
    seg_mask[2] = False                             # sees only the view
    full_mask = view_mask & in_view
    summarized = rest.segment_of(torch.arange(num_tokens))
    summarized[torch.isin(torch.arange(num_tokens), rest.anchors)] = -1
    for t in range(num_q):                          # token j of a summary is visible iff its summary is
        hit = summarized >= 0
        full_mask[t, hit] = seg_mask[t, summarized[hit]]
    want_out, want_lse = ref.attention_with_lse(q, keys, values, mask=full_mask)
    out_view, lse_view = ref.attention_with_lse(q, keys[in_view], values[in_view], mask=view_mask[:, in_view])
    mask = seg_mask.to(torch.int32) if seed % 2 else seg_mask
    out, lse = ref.coarse_merge(q, out_view, lse_view, summ.keys, summ.values, summ.num_tokens, mask=mask)
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, want_lse, rtol=1e-10, atol=1e-10)
    assert lse[0].eq(float("-inf")).all() and out[0].eq(0).all()
    assert torch.equal(out[2], out_view[2]) and torch.equal(lse[2], lse_view[2])
    assert (out_view[3:] - want_out[3:]).abs().max() > 1e-2     # the summaries matter


def test_all_expanded_no_summaries_equals_full_attention():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(5, 6, 16, generator=g, dtype=F64)
    keys = torch.randn(40, 2, 16, generator=g, dtype=F64)
    values = torch.randn(40, 2, 16, generator=g, dtype=F64)
    want_out, want_lse = ref.attention_with_lse(q, keys, values, causal_offset=35)
    empty = torch.zeros(0, 2, 16, dtype=F64)
    out, lse = ref.coarse_merge(q, want_out, want_lse, empty, empty, torch.zeros(0, dtype=torch.int64))
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    # summaries that stand for nothing (n = 0) or that nobody sees change nothing
    junk = torch.randn(3, 2, 16, generator=g, dtype=F64) * 100
    out, lse = ref.coarse_merge(q, want_out, want_lse, junk, junk, torch.tensor([0, 0, 0]))
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    out, lse = ref.coarse_merge(q, want_out, want_lse, junk, junk, torch.tensor([1, 5, 9]),
                                mask=torch.zeros(5, 3, dtype=torch.bool))
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("with_mask", [False, True], ids=["all-visible", "masked"])
def test_empty_view_equals_attention_over_summaries(with_mask):
    g = torch.Generator().manual_seed(4)
    q = torch.randn(7, 6, 16, generator=g, dtype=F64)
    k_sum = torch.randn(5, 2, 16, generator=g, dtype=F64)
    v_sum = torch.randn(5, 2, 16, generator=g, dtype=F64)
    n = torch.tensor([3, 1, 0, 7, 2])
    mask = None
    if with_mask:
        mask = torch.rand(7, 5, generator=g) < 0.6
        mask[:, 0] = True                            # every row sees a summary (else: pass-through)
        mask[3, 1:] = False
    out_view = torch.full((7, 6, 16), float("nan"), dtype=F64)    # never read
    lse_view = torch.full((7, 6), float("-inf"), dtype=F64)
    out, lse = ref.coarse_merge(q, out_view, lse_view, k_sum, v_sum, n, mask=mask)
    # n[s] explicit copies of each summary: the definition of the log(n) term
    k_rep, v_rep = k_sum.repeat_interleave(n, 0), v_sum.repeat_interleave(n, 0)
    tok_mask = None if mask is None else mask.repeat_interleave(n, 1)
    want_out, want_lse = ref.attention_with_lse(q, k_rep, v_rep, mask=tok_mask)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_attention_with_lse_matches_direct_softmax():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(4, 3, 8, generator=g, dtype=F64)
    k = torch.randn(10, 1, 8, generator=g, dtype=F64)
    v = torch.randn(10, 1, 8, generator=g, dtype=F64)
    out, lse = ref.attention_with_lse(q, k, v, scale=0.3, causal_offset=5)
    for t in range(4):
        logits = 0.3 * q[t] @ k[:6 + t, 0].T                       # [3, 6 + t]
        torch.testing.assert_close(lse[t], torch.logsumexp(logits, -1))
        torch.testing.assert_close(out[t], torch.softmax(logits, -1) @ v[:6 + t, 0])


def test_half_inputs_return_their_dtype_and_float32_lse():
    g = torch.Generator().manual_seed(6)
    q = torch.randn(3, 4, 16, generator=g).bfloat16()
    kv = torch.randn(2, 2, 16, generator=g).bfloat16()
    out, lse = ref.coarse_merge(q, q, torch.zeros(3, 4), kv, kv, torch.tensor([2, 3]))
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert torch.isfinite(out.float()).all() and (lse > 0).all()


def test_validation():
    q = torch.randn(3, 4, 8)
    lv = torch.zeros(3, 4)
    kv = torch.randn(5, 2, 8)
    n = torch.ones(5)
    with pytest.raises(ValueError, match="out_view"):
        ref.coarse_merge(q, q[:2], lv, kv, kv, n)
    with pytest.raises(ValueError, match="lse_view"):
        ref.coarse_merge(q, q, lv.T, kv, kv, n)
    with pytest.raises(ValueError, match="multiple"):
        ref.coarse_merge(q, q, lv, torch.randn(5, 3, 8), torch.randn(5, 3, 8), n)
    with pytest.raises(ValueError, match="summary_tokens"):
        ref.coarse_merge(q, q, lv, kv, kv, n[:4])
    with pytest.raises(ValueError, match="mask"):
        ref.coarse_merge(q, q, lv, kv, kv, n, mask=torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask"):
        ref.coarse_merge(q, q, lv, kv, kv, n, mask=torch.ones(3, 5))
    with pytest.raises(ValueError, match="dtype"):
        ref.coarse_merge(q, q.half(), lv, kv, kv, n)
    with pytest.raises(ValueError, match="k_sum"):
        ref.coarse_merge(q, q, lv, torch.randn(5, 2, 4), torch.randn(5, 2, 4), n)


# ---------------------------------------------------------------- Triton kernel (CUDA)

GPU_SHAPES = [  # tokens, q_heads, kv_heads, summaries, head_dim
    pytest.param(37, 6, 2, 45, 64, id="T37-gqa3-S45-D64"),
    pytest.param(1, 4, 4, 130, 128, id="T1-mha-S130-D128"),
    pytest.param(130, 12, 4, 1, 96, id="T130-gqa3-S1-D96"),
    pytest.param(200, 8, 8, 257, 128, id="T200-mha-S257-D128"),
    pytest.param(17, 6, 2, 0, 64, id="T17-gqa3-S0-D64"),
]
# Both sides take the same half inputs and accumulate in float32; the kernel casts
# probabilities to the input dtype for p @ v (as flash attention does) and both
# round the output to it: the output tolerance is a few units in its last place.
TOLERANCES = {torch.bfloat16: dict(rtol=2e-2, atol=2e-2), torch.float16: dict(rtol=3e-3, atol=3e-3)}


def _gpu_inputs(tokens, q_heads, kv_heads, summaries, head_dim, dtype, with_mask, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = (torch.randn(tokens, q_heads, head_dim, device="cuda", generator=g) * 2).to(dtype)
    out_view = torch.randn(tokens, q_heads, head_dim, device="cuda", generator=g).to(dtype)
    lse_view = torch.randn(tokens, q_heads, device="cuda", generator=g) * 3 + 2
    k_sum = torch.randn(summaries, kv_heads, head_dim, device="cuda", generator=g).to(dtype)
    v_sum = torch.randn(summaries, kv_heads, head_dim, device="cuda", generator=g).to(dtype)
    n = torch.randint(0, 40, (summaries,), device="cuda", generator=g)
    lse_view[tokens // 2] = float("-inf")           # no view key visible: out_view is ignored
    out_view[tokens // 2] = float("nan")
    mask = None
    if with_mask:
        mask = torch.rand(tokens, summaries, device="cuda", generator=g) < 0.5
        mask[tokens - 1] = False                    # no summary visible: pass-through
    return q, out_view, lse_view, k_sum, v_sum, n, mask


@pytest.mark.parametrize("num_splits", [None, 1, 3], ids=["auto", "fused", "split3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("with_mask", [False, True], ids=["no-mask", "mask"])
@pytest.mark.parametrize("tokens,q_heads,kv_heads,summaries,head_dim", GPU_SHAPES)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_matches_reference(tokens, q_heads, kv_heads, summaries, head_dim, with_mask, dtype, num_splits):
    from vllm_sekv.ops.coarse import coarse_kernel as kernel

    args = _gpu_inputs(tokens, q_heads, kv_heads, summaries, head_dim, dtype, with_mask)
    cfg = kernel.CoarseConfig(num_splits=num_splits)
    out, lse = kernel.coarse_merge(*args[:6], mask=args[6], config=cfg)
    want_out, want_lse = ref.coarse_merge(*args[:6], mask=args[6])
    assert out.dtype == dtype and lse.dtype == torch.float32
    # NaN only where the NaN out_view row passes through (it sees no summary)
    assert torch.equal(out.isnan(), want_out.isnan()) and not lse.isnan().any()
    torch.testing.assert_close(out.float(), want_out.float(), equal_nan=True, **TOLERANCES[dtype])
    torch.testing.assert_close(lse, want_lse, rtol=1e-4, atol=1e-4)
    if with_mask or summaries == 0:                 # exact pass-through rows
        row = tokens - 1
        assert torch.equal(out[row].view(torch.int16), args[1][row].view(torch.int16))   # bit for bit
        assert torch.equal(lse[row], args[2][row])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_strided_inputs_fp32_and_scale():
    from vllm_sekv.ops.coarse import coarse_kernel as kernel

    q, out_view, lse_view, k_sum, v_sum, n, mask = _gpu_inputs(45, 6, 2, 70, 64, torch.float32, True, seed=1)
    qkv = torch.cat([q, q, q], dim=1)                 # q as a strided slice of a fused tensor
    lse_hm = lse_view.T.contiguous()                  # [Hq, T] storage, passed transposed
    mask_t = mask.T.contiguous().T                    # column-major mask
    args = (qkv[:, 6:12], out_view, lse_hm.T, k_sum, v_sum, n.float())
    want_out, want_lse = ref.coarse_merge(*args, scale=0.2, mask=mask_t)
    for splits in (1, 2):
        out, lse = kernel.coarse_merge(*args, scale=0.2, mask=mask_t, config=kernel.CoarseConfig(num_splits=splits))
        torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="CUDA"):
        kernel.coarse_merge(*(x.cpu() for x in args))
    with pytest.raises(ValueError, match="dtype"):
        kernel.coarse_merge(*(x.double() if x.is_floating_point() else x for x in args[:5]), n)
