"""SeKV coarse attention, scheduler side: which summaries stand in for the
history a view leaves out.

Pure numpy/torch, no vLLM. A view holds some history tokens exactly (whole
blocks and anchors, `workspace.view_passes`). Every other history token enters the
summary of its surprisal segment (`workspace.segments`; a segment's anchor is
never summarized, as in `segment_summaries`): one pseudo-key and value per
segment, the surprisal-weighted means of the segment's left-out tokens, which
the attention hook merges into the view's attention with its logit raised by
`log n` (n = tokens it stands for; `ops/coarse`). A segment wholly
in the view has no summary, so a view that holds the whole history is plain
attention.

Summaries take room in the view: each costs one token's KV on the device. At
most `max_summaries` are made; when the left-out history has more segments,
consecutive segments are merged into that many groups of about equal segment
count (coarser summaries, the same total of tokens).

Each summary's key is placed at a view position (RoPE is applied there, like
any key): the number of view history tokens that precede the summary's first
token in virtual order, i.e. where its tokens would have sat in the view.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from vllm_sekv.workspace.segment_summaries import summary_token_weights
from vllm_sekv.workspace.segments import clean_surprisal, segment


@dataclass(frozen=True)
class CoarsePlan:
    """The summaries of one view: tokens in virtual order, grouped."""

    positions: np.ndarray  # [n] int64: virtual positions of the summarized tokens, ascending
    summary_of: np.ndarray  # [n] int64: the summary each enters (0 .. S-1, non-decreasing)
    surprisal: np.ndarray  # [n] float32: H_t (>= 0, finite), the weights' numerators
    summary_positions: np.ndarray  # [S] int64: view position of each summary's key
    num_tokens: np.ndarray  # [S] int64: n_s, tokens each summary stands for (> 0)

    @property
    def num_summaries(self) -> int:
        return len(self.num_tokens)


def empty_plan() -> CoarsePlan:
    none = np.zeros(0, dtype=np.int64)
    return CoarsePlan(none, none, np.zeros(0, dtype=np.float32), none, none)


def plan_summaries(
    surprisal: np.ndarray, view_virtual: Sequence[int], alpha: float, max_summaries: int
) -> CoarsePlan:
    """The summaries standing in for history tokens `0 .. len(surprisal) - 1`
    that are not at `view_virtual` (the sorted virtual positions of the view's
    history tokens). `surprisal` [N] float (NaN: unknown, weighs 0; segments
    then follow the known values, `segments.segment`). At most `max_summaries`
    summaries (0: none)."""
    num_history = len(surprisal)
    view = np.asarray(view_virtual, dtype=np.int64)
    if max_summaries <= 0 or num_history == 0:
        return empty_plan()
    if len(view) and (view[-1] >= num_history or np.any(np.diff(view) <= 0)):
        raise ValueError("view_virtual must be strictly increasing positions inside the history")
    h = clean_surprisal(surprisal)
    segments = segment(h, alpha)
    seg_of, _, _ = summary_token_weights(torch.from_numpy(h), segments)  # anchors: -1
    seg_of = seg_of.numpy().copy()
    seg_of[view] = -1
    positions = np.nonzero(seg_of >= 0)[0].astype(np.int64)
    if not len(positions):
        return empty_plan()
    _, summary_of = np.unique(seg_of[positions], return_inverse=True)
    num_segments = int(summary_of.max()) + 1
    if num_segments > max_summaries:  # merge consecutive segments into max_summaries groups
        summary_of = summary_of * max_summaries // num_segments
        num_segments = max_summaries
    summary_of = summary_of.astype(np.int64)
    firsts = positions[np.searchsorted(summary_of, np.arange(num_segments))]
    return CoarsePlan(
        positions=positions,
        summary_of=summary_of,
        surprisal=h[positions].astype(np.float32),
        summary_positions=np.searchsorted(view, firsts).astype(np.int64),
        num_tokens=np.bincount(summary_of, minlength=num_segments).astype(np.int64),
    )
