"""PyTorch reference for Mean-K block scoring (same signature as `kernel.py`).

For queries `q[l, h, t, :]` and the block index `k[b, l, g, :]` (g = h // (Hq // Hkv),
grouped-query attention), the relevance of block b is

    S[l, h, b] = sum_t softmax_b(q[l, h, t] . k[b, l, g] / sqrt(d))
    R[b]       = combine over (l, h) of S[l, h, b]     (combine = "mean" or "max")

Only the first `num_blocks` rows of the index take part (the index may be a
preallocated buffer). "mean" is KVMEM's rule; "max" keeps the few retrieval heads
that averaging drowns (DESIGN.md, "What one measurement already says").

Runs on any device, float32 arithmetic, one layer at a time (peak extra memory
about `q_heads * tokens * num_blocks * 4` bytes). Pure function: mutates nothing.
"""
from __future__ import annotations

import math

import torch

COMBINE_MODES = ("mean", "max")


def check_scoring_args(queries: torch.Tensor, index: torch.Tensor, num_blocks: int | None, combine: str) -> int:
    """Validate shapes; return the number of valid blocks. Raises ValueError."""
    if queries.dim() != 4:
        raise ValueError(f"queries must be [layers, q_heads, tokens, head_dim], got {tuple(queries.shape)}")
    if index.dim() != 4:
        raise ValueError(f"index must be [blocks, layers, kv_heads, head_dim], got {tuple(index.shape)}")
    num_layers, q_heads, _, head_dim = queries.shape
    _, idx_layers, kv_heads, idx_dim = index.shape
    if idx_layers != num_layers or idx_dim != head_dim:
        raise ValueError(f"index {tuple(index.shape)} does not match queries {tuple(queries.shape)}")
    if kv_heads == 0 or q_heads % kv_heads != 0:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})")
    if combine not in COMBINE_MODES:
        raise ValueError(f"combine must be one of {COMBINE_MODES}, got {combine!r}")
    if num_blocks is None:
        num_blocks = index.shape[0]
    if not 0 <= num_blocks <= index.shape[0]:
        raise ValueError(f"num_blocks={num_blocks} outside [0, {index.shape[0]}]")
    return int(num_blocks)


def score_blocks(
    queries: torch.Tensor,
    index: torch.Tensor,
    num_blocks: int | None = None,
    combine: str = "max",
) -> torch.Tensor:
    """Relevance `R[num_blocks]` (float32, on the queries' device) of each index block.

    queries: [layers, q_heads, tokens, head_dim]; index: [blocks, layers, kv_heads,
    head_dim] (same dtype family, any float dtype); num_blocks: valid leading rows of
    the index (default: all). Empty when num_blocks == 0 or tokens == 0.
    """
    num_blocks = check_scoring_args(queries, index, num_blocks, combine)
    num_layers, q_heads, num_tokens, head_dim = queries.shape
    kv_heads = index.shape[2]
    group = q_heads // kv_heads
    if num_blocks == 0 or num_tokens == 0:
        return torch.zeros(num_blocks, dtype=torch.float32, device=queries.device)
    scale = 1.0 / math.sqrt(head_dim)
    per_layer = []
    for layer in range(num_layers):
        q = queries[layer].to(torch.float32)  # [Hq, T, D]
        k = index[:num_blocks, layer].to(device=queries.device, dtype=torch.float32)  # [B, Hkv, D]
        k = k.permute(1, 2, 0).repeat_interleave(group, dim=0)  # [Hq, D, B]
        probs = torch.softmax(torch.bmm(q, k) * scale, dim=-1)  # [Hq, T, B]
        per_layer.append(probs.sum(dim=1))  # [Hq, B]
    scores = torch.stack(per_layer).reshape(num_layers * q_heads, num_blocks)
    if combine == "mean":
        return scores.mean(dim=0)
    return scores.amax(dim=0)
