"""SeKV segment summaries: one surprisal-weighted mean key and value per segment.

Pure torch, no vLLM. For each segment ``s`` (see ``segments.py``), layer and KV
head, over the segment's *summarized tokens* ``T_s``:

    w_t   = H_t / sum_{u in T_s} H_u       (uniform 1/|T_s| when that sum is 0)
    k_s   = sum_{t in T_s} w_t * k_t       (pre-RoPE keys)
    v_s   = sum_{t in T_s} w_t * v_t
    n_s   = |T_s|

with ``H`` sanitized as in ``surprisal_weights`` (negative / non-finite -> 0).
``T_s`` is the whole segment, except that by default (``exclude_anchors=True``)
an anchor-started segment leaves its anchor out: anchors are always kept at
full resolution in a view, so a summary that also held the anchor would count
it twice in coarse attention (and the anchor, the segment's most surprising
token, would dominate the weighted mean). A segment that is only its anchor
then has ``n_s = 0`` and a zero summary: it stands for nothing, and the coarse
merge (``ops/coarse``) ignores summaries with ``n_s <= 0``.

In coarse attention a summary acts as ``n_s`` identical keys ``k_s`` with value
``v_s`` (logit ``q.k_s * scale + log n_s``); this is exact when the segment's
summarized keys are identical, and an approximation otherwise.

Shapes: keys / values ``[T, H, D]`` (one layer) or ``[L, T, H, D]``; surprisal
``[T]``; the ``T`` tokens are the session's tokens ``token_offset ..
token_offset + T - 1`` and every segment must lie inside that range (segments
may leave gaps: tokens in no segment are ignored). Output ``[S, H, D]`` or
``[L, S, H, D]`` in the keys' dtype (accumulated in float32, or float64 for
float64 inputs), plus ``n [S]`` int64, both on the keys' device.

Pure and blocking: inputs are never modified; bad shapes raise ``ValueError``
naming the argument. Vectorized (one gather and one ``index_add_`` per tensor,
no Python loop over tokens or segments).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .segments import Segments

__all__ = ["SegmentSummaries", "group_weights", "summary_token_weights", "summarize_segments"]


@dataclass(frozen=True)
class SegmentSummaries:
    """keys / values: [S, H, D] or [L, S, H, D]; num_tokens: [S] int64, the n_s
    each summary stands for (0: nothing summarized, the summary is zero)."""

    keys: Tensor
    values: Tensor
    num_tokens: Tensor


def _clean(surprisal: Tensor) -> Tensor:
    h = torch.nan_to_num(surprisal, nan=0.0, posinf=0.0, neginf=0.0)
    return h.clamp_min(0.0)


def summary_token_weights(surprisal: Tensor, segments: Segments, token_offset: int = 0,
                          exclude_anchors: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """Which tokens each summary uses, and their weights.

    surprisal: [T] for tokens ``token_offset ..``. Returns ``(segment_ids [T] int64,
    weights [T], num_tokens [S] int64)``: ``segment_ids[t]`` is the segment whose
    summary token t enters, -1 when it enters none (outside every segment, or an
    excluded anchor); ``weights`` (float32, float64 for float64 surprisal, on the
    surprisal's device) is ``w_t`` for those tokens and 0 elsewhere.
    """
    if not isinstance(surprisal, Tensor) or surprisal.dim() != 1:
        raise ValueError("surprisal must be a 1-D tensor [T]")
    if isinstance(token_offset, bool) or not isinstance(token_offset, int) or token_offset < 0:
        raise ValueError(f"token_offset must be an int >= 0, got {token_offset!r}")
    num_tokens = surprisal.shape[0]
    if segments.num_segments and (int(segments.starts[0]) < token_offset
                                  or segments.num_tokens > token_offset + num_tokens):
        raise ValueError(f"segments [{int(segments.starts[0])}, {segments.num_tokens}) do not lie inside the "
                         f"tokens [{token_offset}, {token_offset + num_tokens}) of surprisal")
    dev = surprisal.device
    acc = torch.float64 if surprisal.dtype == torch.float64 else torch.float32
    num_segments = segments.num_segments
    tokens = torch.arange(token_offset, token_offset + num_tokens, dtype=torch.int64)
    seg = segments.segment_of(tokens)
    if exclude_anchors and num_segments:
        s = seg.clamp_min(0)
        is_anchor_token = (seg >= 0) & segments.is_anchor[s] & (tokens == segments.starts[s])
        seg = torch.where(is_anchor_token, torch.full_like(seg, -1), seg)
    seg = seg.to(dev)
    used = torch.nonzero(seg >= 0).squeeze(1)
    w_used, count = group_weights(seg[used], surprisal[used].to(acc), num_segments)
    w = torch.zeros(num_tokens, dtype=acc, device=dev).index_put_((used,), w_used)
    return seg, w, count


def group_weights(group: Tensor, surprisal: Tensor, num_groups: int) -> tuple[Tensor, Tensor]:
    """The summary weights of tokens that enter summaries: ``group [n]`` int64
    (0 .. num_groups - 1), ``surprisal [n]`` (sanitized here). Returns ``(w [n]
    in the surprisal's float dtype, count [num_groups] int64)`` with
    ``w_t = H_t / sum of H over t's group``, uniform ``1 / count`` in a group
    whose sum is 0."""
    h = _clean(surprisal)
    count = torch.zeros(num_groups, dtype=torch.int64, device=h.device).index_add_(
        0, group, torch.ones_like(group))
    total = torch.zeros(num_groups, dtype=h.dtype, device=h.device).index_add_(0, group, h)
    t_total, t_count = total[group], count[group].to(h.dtype)
    return torch.where(t_total > 0, h / torch.where(t_total > 0, t_total, 1.0), 1.0 / t_count), count


def summarize_segments(keys: Tensor, values: Tensor, surprisal: Tensor, segments: Segments,
                       token_offset: int = 0, exclude_anchors: bool = True) -> SegmentSummaries:
    """Surprisal-weighted mean key and value of every segment (module docstring).

    keys, values: [T, H, D] or [L, T, H, D] (pre-RoPE keys); surprisal: [T] (any
    device, moved to the keys'). Returns :class:`SegmentSummaries`.
    """
    if not isinstance(keys, Tensor) or keys.dim() not in (3, 4):
        raise ValueError("keys must be [T, H, D] or [L, T, H, D]")
    if not isinstance(values, Tensor) or values.shape != keys.shape:
        raise ValueError(f"values must have the keys' shape {tuple(keys.shape)}")
    if not keys.is_floating_point() or not values.is_floating_point():
        raise ValueError("keys and values must be floating point")
    single = keys.dim() == 3
    k = keys[None] if single else keys
    v = values[None] if single else values
    if not isinstance(surprisal, Tensor) or surprisal.shape != (k.shape[1],):
        raise ValueError(f"surprisal must be [T] = [{k.shape[1]}], got "
                         f"{tuple(surprisal.shape) if isinstance(surprisal, Tensor) else type(surprisal)}")
    acc = torch.float64 if keys.dtype == torch.float64 else torch.float32
    seg, w, count = summary_token_weights(surprisal.to(keys.device, acc), segments, token_offset, exclude_anchors)
    used = torch.nonzero(seg >= 0).squeeze(1)
    idx, wu = seg[used], w[used][None, :, None, None]
    num_layers, _, num_heads, head_dim = k.shape
    shape = (num_layers, segments.num_segments, num_heads, head_dim)
    k_sum = torch.zeros(shape, dtype=acc, device=keys.device).index_add_(1, idx, k[:, used].to(acc) * wu)
    v_sum = torch.zeros(shape, dtype=acc, device=keys.device).index_add_(1, idx, v[:, used].to(acc) * wu)
    k_sum, v_sum = k_sum.to(keys.dtype), v_sum.to(values.dtype)
    if single:
        k_sum, v_sum = k_sum[0], v_sum[0]
    return SegmentSummaries(k_sum, v_sum, count)
