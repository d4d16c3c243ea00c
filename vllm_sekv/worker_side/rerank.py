"""Token-level re-rank of a probe's best candidate blocks, worker side.

The block index scores a block by a few summary vectors of its keys; two
blocks that differ in one token (a fact and its look-alike: the same
sentence about another service, another variable) score alike. The re-rank
scores the index's best candidates again with their actual keys: the probe
queries' attention over every token of those candidates.

Each candidate is placed at the same distance before the queries (its keys,
stored rotated to their virtual positions, are rotated to positions
`first query - distance + j`), so that no block wins by where it happens to
lie; the distance is half the view, where a selected block sits on average.
Per layer and query head, each query's softmax runs over all the candidates'
tokens; a block's mass is the sum over its tokens and over the queries, and
the heads combine as the index's do (`block_summaries.combine_heads`): all
of them, or only the model's retrieval heads (config `rerank_heads_path`).

Runs in the worker process, on the forward thread, after the probe's last
layer; candidates are read from the host tier in chunks (`read_keys`) so the
device holds at most `chunk_blocks` blocks of keys at a time. Blocking: the
caller reads the result on the host.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from vllm_sekv.ops import RopeSpec, rotate_keys
from vllm_sekv.index.block_summaries import combine_heads

# host slots -> their keys [n, num_layers, block_tokens, kv_heads, head_dim]
KeyReader = Callable[[list[int]], torch.Tensor]


def rerank(queries: torch.Tensor, query_positions: torch.Tensor, slots: list[int], starts: torch.Tensor,
           read_keys: KeyReader, rope: RopeSpec, distance: int, combine: str,
           chunk_blocks: int = 256, heads: torch.Tensor | None = None) -> torch.Tensor:
    """queries [L, m, Hq, D] post-RoPE at `query_positions` [m]; candidate
    blocks in host `slots` [M] whose first tokens sit at virtual positions
    `starts` [M] -> [M] relevance (combined attention mass, >= 0). `heads`:
    the (layer * Hq + query head) indices whose mass is combined (None:
    every head; `index.retrieval_heads`)."""
    num_layers, m, q_heads, head_dim = queries.shape
    device = queries.device
    num_blocks = len(slots)
    place = int(query_positions.min()) - distance  # every candidate's first token goes here
    lse = torch.zeros((num_layers, m, q_heads, num_blocks), dtype=torch.float32, device=device)
    # with retrieval heads, only their layers are scored (the others' rows stay unused)
    layers = range(num_layers) if heads is None else sorted({int(h) // q_heads for h in heads.tolist()})
    q = queries.float() / math.sqrt(head_dim)
    for lo in range(0, num_blocks, chunk_blocks):
        hi = min(lo + chunk_blocks, num_blocks)
        keys = read_keys(slots[lo:hi]).to(device)  # [c, L, T, Hkv, D], at their virtual positions
        c, _, tokens, kv_heads, _ = keys.shape
        flat = keys.permute(0, 2, 1, 3, 4).reshape(c * tokens, num_layers * kv_heads, head_dim).float()
        shift = (place - starts[lo:hi].to(device)).repeat_interleave(tokens)
        moved = rotate_keys(flat, shift, rope).reshape(c, tokens, num_layers, kv_heads, head_dim)
        group = q_heads // kv_heads
        for layer in layers:
            k = moved[:, :, layer]  # [c, T, Hkv, D]
            qs = q[layer].reshape(m, kv_heads, group, head_dim)
            logits = torch.einsum("mhgd,cthd->mhgct", qs, k)  # [m, Hkv, group, c, T]
            lse[layer, :, :, lo:hi] = logits.logsumexp(-1).reshape(m, q_heads, c)
    mass = torch.softmax(lse, dim=-1).sum(1).flatten(0, 1)  # [L * Hq, M]: over queries
    return combine_heads(mass if heads is None else mass[heads.to(device)], combine)
