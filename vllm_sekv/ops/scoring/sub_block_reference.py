"""PyTorch reference of sub-block scoring (`sub_block_scoring.score_sub_blocks`).

One layer of `BlockIndex.score` for the summary kinds scored by logsumexp
over a block's S vectors (`sub4_pre`, `mean_pre`, ...), candidates picked by
slot; same contract as the Triton kernel, on any device, float32. Pure
functions: mutate nothing.
"""
from __future__ import annotations

import math

import torch

SUB_BLOCK_QUERY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SUB_BLOCK_ENTRY_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_sub_block_args(queries: torch.Tensor, entries: torch.Tensor, layer: int, slots: torch.Tensor,
                         valid: torch.Tensor) -> None:
    """Validate the arguments of `score_sub_blocks` (shapes, dtypes, one device).
    Raises ValueError naming the offending argument. Reads no tensor data."""
    if not isinstance(queries, torch.Tensor) or queries.dim() != 3:
        raise ValueError(f"queries must be [M, Hq, D], got {getattr(queries, 'shape', type(queries))}")
    if queries.dtype not in SUB_BLOCK_QUERY_DTYPES:
        raise ValueError(f"queries dtype {queries.dtype} not in {SUB_BLOCK_QUERY_DTYPES}")
    if not isinstance(entries, torch.Tensor) or entries.dim() != 5:
        raise ValueError(f"entries must be [num_slots, L, S, H, D], got {getattr(entries, 'shape', type(entries))}")
    if entries.dtype not in SUB_BLOCK_ENTRY_DTYPES:
        raise ValueError(f"entries dtype {entries.dtype} not in {SUB_BLOCK_ENTRY_DTYPES}")
    num_slots, num_layers, s, kv_heads, head_dim = entries.shape
    _, q_heads, q_dim = queries.shape
    if q_dim != head_dim:
        raise ValueError(f"queries head_dim {q_dim} != entries head_dim {head_dim}")
    if s == 0 or kv_heads == 0 or head_dim == 0 or q_heads % kv_heads != 0:
        raise ValueError(f"entries {tuple(entries.shape)}: need S, H, D > 0 and q_heads ({q_heads}) "
                         f"a multiple of kv_heads ({kv_heads})")
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < num_layers:
        raise ValueError(f"layer must be an int in [0, {num_layers}), got {layer!r}")
    if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype != torch.int64:
        raise ValueError(f"slots must be a 1-D int64 tensor, got "
                         f"{getattr(slots, 'dtype', type(slots))} {tuple(getattr(slots, 'shape', ()))}")
    if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool or tuple(valid.shape) != (num_slots,):
        raise ValueError(f"valid must be a bool tensor [num_slots={num_slots}], got "
                         f"{getattr(valid, 'dtype', type(valid))} {tuple(getattr(valid, 'shape', ()))}")
    for name, t in (("entries", entries), ("slots", slots), ("valid", valid)):
        if t.device != queries.device:
            raise ValueError(f"{name} is on {t.device}, queries on {queries.device}: all must share one device")


def score_sub_blocks_reference(queries: torch.Tensor, entries: torch.Tensor, layer: int, slots: torch.Tensor,
                               valid: torch.Tensor) -> torch.Tensor:
    """Per-head relevance of candidate blocks scored by logsumexp over their S
    vectors (`block_summaries._lse_logits` kinds: `sub4_pre`, `mean_pre`, ...); the
    same contract as `sub_block_scoring.score_sub_blocks`, on any device, float32.

    queries [M, Hq, D], entries [num_slots, L, S, H, D], candidate `slots` [B]
    int64, `valid` [num_slots] bool, all on one device ->

        logit[m, h, b] = logsumexp_s(q[m, h] . entries[slots[b], layer, s, h // (Hq // H)] / sqrt(D))
        out[h, b]      = sum_m softmax_b(logit[m, h, :], invalid candidates masked to -inf)[b]

    [Hq, B] float32. Invalid candidates score 0; a query with no valid candidate
    contributes 0. Equals `BlockIndex.score` for logsumexp kinds (gathers a
    float32 copy of the candidates' entries: B * S * H * D * 4 bytes, plus the
    M * Hq * B * S dot products). Pure function.
    """
    check_sub_block_args(queries, entries, layer, slots, valid)
    num_queries, q_heads, head_dim = queries.shape
    kv_heads = entries.shape[3]
    group = q_heads // kv_heads
    e = entries[slots, layer].float()  # [B, S, H, D]
    q = queries.float().reshape(num_queries, kv_heads, group, head_dim)
    dots = torch.einsum("mgrd,bsgd->mgrbs", q, e) / math.sqrt(head_dim)
    logits = torch.logsumexp(dots, dim=-1).reshape(num_queries, q_heads, slots.shape[0])
    ok = valid[slots]
    probs = torch.softmax(logits.masked_fill(~ok, float("-inf")), dim=-1)
    return probs.nan_to_num_(0.0).sum(dim=0)
