"""The Mean-K block index: one mean pre-RoPE key per block, per layer, per KV head.

Entry `keys[slot]` is `[num_layers, kv_heads, head_dim]` (float32) for the block
held in host slot `slot`, valid while `valid[slot]`. Keys are stored post-RoPE,
so each token's key is first rotated back by its position (a pure rotation by
`-position` built from the model's inverse frequencies), then averaged.

Runs in the worker process, on the forward thread; `add` is blocking and writes
only its slot's entry.
"""
from __future__ import annotations

import torch

from vllm_sekv.ops import RopeSpec, rotate_keys
from vllm_sekv.store import HostPool


class MeanKIndex:
    def __init__(
        self, num_slots: int, num_layers: int, kv_heads: int, head_dim: int, rope: RopeSpec
    ) -> None:
        self.rope = rope
        self.keys = torch.zeros((num_slots, num_layers, kv_heads, head_dim), dtype=torch.float32)
        self.valid = torch.zeros(num_slots, dtype=torch.bool)

    def add(self, pool: HostPool, slot: int, start_token: int) -> None:
        """Index the block in `slot`, whose first token sits at `start_token`."""
        keys = pool.block_keys(slot)  # [L, T, H, D], post-RoPE
        num_layers, num_tokens, kv_heads, head_dim = keys.shape
        per_token = keys.permute(1, 0, 2, 3).reshape(num_tokens, num_layers * kv_heads, head_dim)
        positions = torch.arange(start_token, start_token + num_tokens, dtype=torch.int64)
        pre_rope = rotate_keys(per_token.float(), -positions, self.rope)
        self.keys[slot] = pre_rope.mean(dim=0).reshape(num_layers, kv_heads, head_dim)
        self.valid[slot] = True

    def drop(self, slot: int) -> None:
        self.valid[slot] = False
