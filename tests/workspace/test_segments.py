"""Surprisal segmentation (vllm_sekv.workspace.segments): a hand-made sequence, a
direct per-token restatement of the definition, chunked == whole, validation,
and the block bookkeeping helpers."""
import math

import numpy as np
import pytest
import torch

from vllm_sekv.workspace import segments as sg
from vllm_sekv.workspace.segments import Segments, SurprisalSegmenter, segment

NAN, INF = float("nan"), float("inf")
# token 0: ignored; 1..6 flat; 7 spikes; 8..12 flat; 13 spikes; 14 is high but not
# enough; 15..19 are -3, NaN, inf, 0, 0, all counted as 0.
HAND = [NAN, 1, 1, 1, 1, 1, 1, 10, 1, 1, 1, 1, 1, 10, 5, -3, NAN, INF, 0, 0]


def _naive_anchors(h, alpha):
    """The definition, token by token: t >= 1 is an anchor iff its (sanitized)
    surprisal exceeds mean + alpha * population std of tokens 1..t."""
    h = np.asarray(h, dtype=np.float64)
    h = np.where(np.isfinite(h) & (h > 0), h, 0.0)
    out = [0] if len(h) else []
    for t in range(1, len(h)):
        w = h[1:t + 1]
        if h[t] > w.mean() + alpha * w.std():
            out.append(t)
    return out


def _random_surprisal(rng, n):
    h = rng.gamma(1.2, 2.5, n)
    spikes = rng.random(n) < 0.03
    h[spikes] += rng.uniform(5, 20, spikes.sum())
    return h


def _same(a: Segments, b: Segments):
    assert torch.equal(a.starts, b.starts) and torch.equal(a.ends, b.ends) and torch.equal(a.is_anchor, b.is_anchor)


def test_hand_made_sequence():
    s = segment(HAND, alpha=2.0, max_segment_tokens=None)
    assert s.anchors.tolist() == [0, 7, 13]
    assert s.starts.tolist() == [0, 7, 13] and s.ends.tolist() == [7, 13, 20]
    assert s.lengths.tolist() == [7, 6, 7] and s.num_tokens == 20
    assert s.starts.dtype == s.ends.dtype == torch.int64
    assert _naive_anchors(HAND, 2.0) == [0, 7, 13]
    # a lower alpha also takes token 14 (5.0 against mean 2.57, std 3.2)
    assert segment(HAND, alpha=0.5, max_segment_tokens=None).anchors.tolist() == [0, 7, 13, 14]


def test_hand_made_sequence_with_length_cap():
    s = segment(HAND, alpha=2.0, max_segment_tokens=4)
    # cuts every 4 tokens after the last anchor: 4 (after 0), 11 (after 7), 17 (after 13)
    assert s.starts.tolist() == [0, 4, 7, 11, 13, 17]
    assert s.ends.tolist() == [4, 7, 11, 13, 17, 20]
    assert s.is_anchor.tolist() == [True, False, True, False, True, False]
    assert s.anchors.tolist() == [0, 7, 13]
    flat = segment(np.ones(600), max_segment_tokens=256)
    assert flat.starts.tolist() == [0, 256, 512] and flat.is_anchor.tolist() == [True, False, False]
    assert int(flat.lengths.max()) <= 256


def test_token_zero_is_an_anchor_and_its_value_is_ignored():
    rng = np.random.default_rng(1)
    h = _random_surprisal(rng, 300)
    base = segment(h)
    for first in (NAN, 0.0, 1e9, -5.0):
        h2 = h.copy()
        h2[0] = first
        _same(segment(h2), base)
    assert segment([3.0]).anchors.tolist() == [0]
    empty = segment([])
    assert empty.num_segments == 0 and empty.num_tokens == 0


@pytest.mark.parametrize("alpha", [0.0, 1.0, 2.0, 3.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_the_definition_token_by_token(seed, alpha):
    rng = np.random.default_rng(seed)
    h = _random_surprisal(rng, 400)
    h[rng.random(400) < 0.05] = NAN
    h[50:80] = 0.0                     # a zero stretch
    got = segment(torch.tensor(h, dtype=torch.float64), alpha, max_segment_tokens=None)
    want = _naive_anchors(h, alpha)
    assert got.anchors.tolist() == want
    assert len(want) > 1               # the check is not vacuous
    assert got.starts.tolist() == want and got.ends.tolist() == want[1:] + [400]


@pytest.mark.parametrize("max_segment_tokens", [None, 7, 256])
@pytest.mark.parametrize("seed", range(6))
def test_chunked_equals_whole(seed, max_segment_tokens):
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(50, 900))
    h = _random_surprisal(rng, n)
    whole = SurprisalSegmenter(2.0, max_segment_tokens)
    whole_anchors = whole.push(h)
    cuts = np.sort(rng.integers(0, n + 1, int(rng.integers(1, 40))))
    cuts = np.concatenate(([0], cuts, [n]))          # repeated cuts give empty chunks
    inc = SurprisalSegmenter(2.0, max_segment_tokens)
    got = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        chunk = torch.tensor(h[a:b], dtype=torch.float32 if seed % 2 else torch.float64)
        if seed % 2:                                # float32 chunks: compare against float32 values
            h[a:b] = chunk.double().numpy()
        anchors = inc.push(chunk)
        assert anchors.dtype == torch.int64
        assert all(a <= t < b for t in anchors.tolist())
        got.append(anchors)
    if seed % 2:
        whole = SurprisalSegmenter(2.0, max_segment_tokens)
        whole_anchors = whole.push(h)
    assert torch.equal(torch.cat(got), whole_anchors)
    assert inc.num_tokens == whole.num_tokens == n
    assert inc.mean == whole.mean and inc.std == whole.std          # bit-identical state
    _same(inc.segments(), whole.segments())
    _same(inc.segments(), segment(h, 2.0, max_segment_tokens))
    assert whole_anchors.numel() > 3


def test_segmenter_stats_and_open_segment():
    seg = SurprisalSegmenter()
    assert math.isnan(seg.mean) and seg.segments().num_segments == 0
    seg.push([NAN, 2.0, 4.0])
    assert seg.mean == pytest.approx(3.0) and seg.std == pytest.approx(1.0)
    assert seg.segments().ends.tolist() == [3]
    seg.push([3.0] * 5)
    s = seg.segments()
    assert s.ends.tolist() == [8] and s.num_tokens == 8       # the open segment grew


@pytest.mark.parametrize("alpha", [-0.1, NAN, INF, "2", None, True])
def test_alpha_validation(alpha):
    with pytest.raises(ValueError, match="alpha"):
        segment([1.0, 2.0], alpha)
    with pytest.raises(ValueError, match="alpha"):
        SurprisalSegmenter(alpha)


def test_argument_validation():
    assert sg.check_alpha(0) == 0.0 and sg.check_alpha(np.float32(2.5)) == 2.5
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="max_segment_tokens"):
            SurprisalSegmenter(max_segment_tokens=bad)
    with pytest.raises(ValueError, match="surprisal"):
        segment(np.zeros((3, 2)))
    with pytest.raises(ValueError, match="non-overlapping"):
        Segments(torch.tensor([0, 3]), torch.tensor([5, 6]), torch.tensor([True, True]))
    with pytest.raises(ValueError, match="non-empty"):
        Segments(torch.tensor([0, 3]), torch.tensor([3, 3]), torch.tensor([True, True]))
    with pytest.raises(ValueError, match="one length"):
        Segments(torch.tensor([0]), torch.tensor([3, 4]), torch.tensor([True]))
    with pytest.raises(ValueError, match="block_tokens"):
        sg.segment_block_ranges(segment(HAND), 0)


def test_take_and_segment_of():
    s = segment(HAND, max_segment_tokens=4)                    # [0,4) [4,7) [7,11) [11,13) [13,17) [17,20)
    sub = s.take(torch.tensor([1, 4]))
    assert sub.starts.tolist() == [4, 13] and sub.ends.tolist() == [7, 17] and sub.is_anchor.tolist() == [False, True]
    assert sub.take(torch.tensor([False, True])).starts.tolist() == [13]
    assert s.segment_of(torch.tensor([0, 3, 4, 12, 13, 19])).tolist() == [0, 0, 1, 3, 4, 5]
    assert sub.segment_of(torch.tensor([3, 4, 6, 7, 13, 16, 17])).tolist() == [-1, 0, 0, -1, 1, 1, -1]
    with pytest.raises(ValueError, match="increasing"):
        s.take(torch.tensor([2, 1]))


def test_block_bookkeeping():
    s = segment(HAND, max_segment_tokens=4)                    # starts 0 4 7 11 13 17, 20 tokens
    first, end = sg.segment_block_ranges(s, 8)
    assert first.tolist() == [0, 0, 0, 1, 1, 2] and end.tolist() == [1, 1, 2, 2, 3, 3]
    bfirst, bend = sg.block_segment_ranges(s, 8)               # blocks [0,8) [8,16) [16,24)
    assert bfirst.tolist() == [0, 2, 4] and bend.tolist() == [3, 5, 6]
    mask = sg.block_anchor_mask(s, 8)
    assert mask.shape == (3, 8) and mask.dtype == torch.bool
    assert torch.nonzero(mask).tolist() == [[0, 0], [0, 7], [1, 5]]      # anchors 0, 7, 13
    assert sg.block_anchor_mask(s, 8, num_blocks=1).sum().item() == 2
    sub = s.take(torch.tensor([0, 5]))                         # a gap over block 1
    bfirst, bend = sg.block_segment_ranges(sub, 8)
    assert bfirst.tolist() == [0, 1, 1] and bend.tolist() == [1, 1, 2]


@pytest.mark.parametrize("seed", range(3))
def test_block_ranges_agree_with_token_membership(seed):
    rng = np.random.default_rng(seed)
    s = segment(_random_surprisal(rng, 500), 1.0, 40)
    bt = 32
    seg_of = s.segment_of(torch.arange(500))
    first, end = sg.segment_block_ranges(s, bt)
    bfirst, bend = sg.block_segment_ranges(s, bt)
    for b in range(len(bfirst)):
        touching = set(seg_of[b * bt:(b + 1) * bt].tolist())
        assert touching == set(range(int(bfirst[b]), int(bend[b])))
        assert all(int(first[x]) <= b < int(end[x]) for x in touching)
    assert sg.block_anchor_mask(s, bt).reshape(-1)[:500].nonzero().squeeze(1).tolist() == s.anchors.tolist()
