"""Top-k block selection with sink and recent blocks forced in.

Device-agnostic torch (topk runs on the scores' device); the only host sync is
the final `.tolist()`-free sort, so the result stays on the scores' device.
Pure function: mutates nothing. Bad arguments raise ValueError.
"""
from __future__ import annotations

import torch


def select_blocks(
    scores: torch.Tensor,
    k: int,
    sink_blocks: int = 1,
    recent_blocks: int = 0,
    candidate_start: int | None = None,
    candidate_end: int | None = None,
) -> torch.Tensor:
    """Sorted int64 block ids: sinks `[0, sink_blocks)`, recents
    `[n - recent_blocks, n)` and the `k` highest-scoring candidates.

    scores: [n] relevance per block (e.g. from `score_blocks`).
    candidate_start / candidate_end: the half-open range the k are chosen from;
        default `[sink_blocks, n - recent_blocks)`. Fewer than k candidates -> all.
    Ties are broken towards the lower block id (stable, deterministic).
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D [num_blocks], got {tuple(scores.shape)}")
    if k < 0 or sink_blocks < 0 or recent_blocks < 0:
        raise ValueError(f"k, sink_blocks, recent_blocks must be >= 0, got {k}, {sink_blocks}, {recent_blocks}")
    num_blocks = scores.shape[0]
    device = scores.device
    sink_end = min(sink_blocks, num_blocks)
    recent_start = max(num_blocks - recent_blocks, sink_end)
    start = sink_end if candidate_start is None else max(0, candidate_start)
    end = recent_start if candidate_end is None else min(num_blocks, candidate_end)
    forced = torch.cat([
        torch.arange(0, sink_end, device=device),
        torch.arange(recent_start, num_blocks, device=device),
    ])
    chosen = forced
    if end > start and k > 0:
        cand = scores[start:end].to(torch.float32)
        # Exclude forced blocks that fall inside a caller-given candidate range.
        cand_ids = torch.arange(start, end, device=device)
        is_forced = (cand_ids < sink_end) | (cand_ids >= recent_start)
        cand = cand.masked_fill(is_forced, float("-inf"))
        num_free = int(end - start - int(is_forced.sum()))
        take = min(k, num_free)
        if take > 0:
            # Stable: sort descending by score, ascending id on ties.
            order = torch.sort(cand, descending=True, stable=True).indices[:take]
            chosen = torch.cat([forced, cand_ids[order]])
    return torch.sort(torch.unique(chosen)).values
