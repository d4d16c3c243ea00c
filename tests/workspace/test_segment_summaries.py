"""Segment summaries (vllm_sekv.workspace.segment_summaries) against a direct
per-segment loop in float64."""
import numpy as np
import pytest
import torch

from vllm_sekv.workspace.segment_summaries import summarize_segments, summary_token_weights
from vllm_sekv.workspace.segments import Segments, segment


def _loop_summaries(keys, values, surprisal, segs, token_offset, exclude_anchors):
    """keys/values [L, T, H, D]: one segment at a time, float64."""
    keys, values = keys.double(), values.double()
    h = torch.nan_to_num(surprisal.double(), nan=0.0, posinf=0.0, neginf=0.0).clamp_min(0)
    ks, vs, ns = [], [], []
    for s in range(segs.num_segments):
        lo, hi = int(segs.starts[s]), int(segs.ends[s])
        if exclude_anchors and bool(segs.is_anchor[s]):
            lo += 1
        idx = torch.arange(lo, hi) - token_offset
        ns.append(len(idx))
        if not len(idx):
            ks.append(torch.zeros_like(keys[:, 0]))
            vs.append(torch.zeros_like(values[:, 0]))
            continue
        w = h[idx]
        w = w / w.sum() if w.sum() > 0 else torch.full_like(w, 1.0 / len(idx))
        ks.append(torch.einsum("t,lthd->lhd", w, keys[:, idx]))
        vs.append(torch.einsum("t,lthd->lhd", w, values[:, idx]))
    return torch.stack(ks, 1), torch.stack(vs, 1), torch.tensor(ns)


def _data(seed, num_tokens, layers=2, heads=3, head_dim=8):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(layers, num_tokens, heads, head_dim, generator=g, dtype=torch.float64)
    values = torch.randn(layers, num_tokens, heads, head_dim, generator=g, dtype=torch.float64)
    h = torch.distributions.Gamma(1.2, 0.4).sample((num_tokens,)).double()
    return keys, values, h


@pytest.mark.parametrize("exclude_anchors", [True, False], ids=["no-anchor", "with-anchor"])
@pytest.mark.parametrize("seed", range(4))
def test_matches_per_segment_loop(seed, exclude_anchors):
    torch.manual_seed(seed)
    keys, values, h = _data(seed, 300)
    segs = segment(h, alpha=1.0, max_segment_tokens=20)
    # zero-surprisal segments (uniform weights) and junk values that count as 0
    for s in (1, 3, segs.num_segments - 1):
        h[int(segs.starts[s]) + 1:int(segs.ends[s])] = 0.0
    h[int(segs.starts[5]) + 1:int(segs.ends[5])] = float("nan")
    h[int(segs.starts[6]) + 1] = -4.0
    out = summarize_segments(keys, values, h, segs, exclude_anchors=exclude_anchors)
    want_k, want_v, want_n = _loop_summaries(keys, values, h, segs, 0, exclude_anchors)
    assert out.keys.shape == (2, segs.num_segments, 3, 8) and out.keys.dtype == torch.float64
    torch.testing.assert_close(out.keys, want_k, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.values, want_v, rtol=1e-12, atol=1e-12)
    assert out.num_tokens.dtype == torch.int64 and out.num_tokens.tolist() == want_n.tolist()
    assert (out.num_tokens == segs.lengths - (segs.is_anchor.long() if exclude_anchors else 0)).all()
    # a zero-surprisal segment is the plain mean of its tokens
    lo, hi = int(segs.starts[1]) + int(exclude_anchors and bool(segs.is_anchor[1])), int(segs.ends[1])
    if hi - lo > 1 and not (float(h[lo]) > 0):
        torch.testing.assert_close(out.keys[:, 1], keys[:, lo:hi].mean(1))


def test_one_layer_offset_gaps_and_anchor_only_segments():
    keys, values, h = _data(7, 60, layers=1)
    # tokens 100..159 of a session; segments with gaps; [110, 111) is only its anchor
    segs = Segments(torch.tensor([100, 110, 115, 140]), torch.tensor([108, 111, 130, 160]),
                    torch.tensor([True, True, False, True]))
    out = summarize_segments(keys[0], values[0], h, segs, token_offset=100)
    want_k, want_v, want_n = _loop_summaries(keys, values, h, segs, 100, True)
    assert out.keys.shape == (4, 3, 8)
    torch.testing.assert_close(out.keys, want_k[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.values, want_v[0], rtol=1e-12, atol=1e-12)
    assert out.num_tokens.tolist() == [7, 0, 15, 19]
    assert (out.keys[1] == 0).all() and (out.values[1] == 0).all()
    seg_ids, w, n = summary_token_weights(h, segs, token_offset=100)
    assert seg_ids[:8].tolist() == [-1] + [0] * 7 and seg_ids[8:11].tolist() == [-1, -1, -1]
    assert (w[seg_ids < 0] == 0).all()
    torch.testing.assert_close(torch.zeros(4, dtype=w.dtype).index_add_(0, seg_ids[seg_ids >= 0], w[seg_ids >= 0]),
                               torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=w.dtype))


def test_half_precision_inputs_keep_their_dtype():
    keys, values, h = _data(3, 100)
    segs = segment(h, alpha=1.0)
    out = summarize_segments(keys.bfloat16(), values.bfloat16(), h.float(), segs)
    want_k, _, _ = _loop_summaries(keys.bfloat16(), values.bfloat16(), h.float(), segs, 0, True)
    assert out.keys.dtype == torch.bfloat16
    torch.testing.assert_close(out.keys.double(), want_k, rtol=1e-2, atol=1e-2)


def test_identical_keys_give_that_key():
    keys, values, h = _data(5, 80, layers=1)
    segs = segment(h, alpha=1.0, max_segment_tokens=16)
    for s in range(segs.num_segments):
        keys[0, int(segs.starts[s]):int(segs.ends[s])] = torch.randn(3, 8, dtype=torch.float64)
    out = summarize_segments(keys, values, h, segs, exclude_anchors=False)
    torch.testing.assert_close(out.keys[0], keys[0, segs.starts], rtol=1e-14, atol=1e-14)


def test_validation():
    keys, values, h = _data(0, 20)
    segs = segment(h)
    with pytest.raises(ValueError, match="values"):
        summarize_segments(keys, values[:, :10], h, segs)
    with pytest.raises(ValueError, match="surprisal"):
        summarize_segments(keys, values, h[:10], segs)
    with pytest.raises(ValueError, match="keys"):
        summarize_segments(keys[0, 0], values[0, 0], h, segs)
    with pytest.raises(ValueError, match="inside"):
        summarize_segments(keys, values, h, segs, token_offset=5)
    with pytest.raises(ValueError, match="token_offset"):
        summary_token_weights(h, segs, token_offset=-1)
    empty = summarize_segments(keys, values, h, Segments(torch.zeros(0), torch.zeros(0), torch.zeros(0)))
    assert empty.keys.shape == (2, 0, 3, 8) and empty.num_tokens.shape == (0,)
    np.testing.assert_array_equal(keys.numpy(), _data(0, 20)[0].numpy())     # inputs untouched
