"""The host-memory tier's bytes: one tensor of fixed-size block slots.

Layout (the workspace's canonical one, shared with the transfer pipeline):
`data[num_slots, 2, num_layers, block_tokens, kv_heads, head_dim]`, index 0 = K
after RoPE at the token's stored position, 1 = V. One slot holds one workspace
block; slot ids are handed out by the scheduler-side catalog.

Runs in the worker process on the forward thread; every call is blocking and
mutates only the slots it is given. Allocation reserves virtual memory only
(pages are touched as slots fill). The tensor is page-aligned (pinned on CUDA)
so that NVMe reads can land in a slot directly.
"""
from __future__ import annotations

import torch

PAGE_BYTES = 4096


class HostPool:
    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        block_tokens: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        pin_memory: bool = False,
    ) -> None:
        self.block_tokens = block_tokens
        shape = (num_slots, 2, num_layers, block_tokens, kv_heads, head_dim)
        if pin_memory:  # pinned allocations are page-aligned already
            self.data = torch.empty(shape, dtype=dtype, pin_memory=True)
            return
        # Page-aligned, so that slots can be the target of O_DIRECT reads.
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = itemsize * num_slots * 2 * num_layers * block_tokens * kv_heads * head_dim
        raw = torch.empty(nbytes + PAGE_BYTES, dtype=torch.uint8)
        offset = -raw.data_ptr() % PAGE_BYTES
        self.data = raw[offset : offset + nbytes].view(dtype).view(shape)

    @property
    def num_slots(self) -> int:
        return self.data.shape[0]

    @property
    def block_bytes(self) -> int:
        return self.data[0].numel() * self.data.element_size()

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_tokens * kv_heads * head_dim * itemsize

    def write_rows(
        self, layer: int, rows: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Store K/V `[n, kv_heads, head_dim]` of one layer at flat token rows
        `rows[n]` (row = slot * block_tokens + offset)."""
        slots, offsets = rows // self.block_tokens, rows % self.block_tokens
        self.data[slots, 0, layer, offsets] = key.to(self.data.dtype)
        self.data[slots, 1, layer, offsets] = value.to(self.data.dtype)

    def read_rows(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V `[n, kv_heads, head_dim]` of one layer at flat token rows."""
        slots, offsets = rows // self.block_tokens, rows % self.block_tokens
        return self.data[slots, 0, layer, offsets], self.data[slots, 1, layer, offsets]

    def block_keys(self, slot: int) -> torch.Tensor:
        """All keys of one slot, `[num_layers, block_tokens, kv_heads, head_dim]` (a view)."""
        return self.data[slot, 0]
