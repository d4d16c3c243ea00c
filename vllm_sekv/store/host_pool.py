"""The host-memory tier's bytes: one tensor of fixed-size block slots.

Layout (the workspace's canonical one, shared with the transfer pipeline):
`data[num_slots, 2, num_layers, block_tokens, kv_heads, head_dim]`, index 0 = K
after RoPE at the token's stored position, 1 = V. One slot holds one workspace
block; slot ids are handed out by the scheduler-side catalog.

Runs in the worker process on the forward thread; every call is blocking and
mutates only the slots it is given. Allocation reserves virtual memory only
(pages are touched as slots fill), except with `pin_memory` (CUDA), where the
whole tier is page-locked at start-up (`cudart.register_host`). The tensor is
page-aligned so that NVMe reads can land in a slot directly.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch

from vllm_sekv.store import cudart
from vllm_sekv.store.slot_runs import runs

PAGE_BYTES = 4096


@dataclass(frozen=True)
class SlotRuns:
    """Rows split for `HostPool.write_rows`: `whole` = (index of the run's
    first row, its first slot, number of slots) for runs of whole consecutive
    slots; `rest` = indices of the other rows."""

    whole: list[tuple[int, int, int]]
    rest: torch.Tensor


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
        # Page-aligned, so that slots can be the target of O_DIRECT reads.
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = itemsize * num_slots * 2 * num_layers * block_tokens * kv_heads * head_dim
        raw = torch.empty(nbytes + PAGE_BYTES, dtype=torch.uint8)
        offset = -raw.data_ptr() % PAGE_BYTES
        self.data = raw[offset : offset + nbytes].view(dtype).view(shape)
        self.pinned = bool(pin_memory and nbytes)  # page-locked: the copy engine reads it directly
        if self.pinned:
            # Pinned at exactly its size (torch's pinned allocator would round
            # it up to a power of two). Touching every page first spreads the
            # page faults over torch's threads; registering then only locks.
            raw.zero_()
            cudart.register_host(self.data.data_ptr(), nbytes)
            weakref.finalize(self, _unpin, self.data.data_ptr())

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
        self, layer: int, rows: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        runs: "SlotRuns | None" = None,
    ) -> None:
        """Store K/V `[n, kv_heads, head_dim]` of one layer at flat token rows
        `rows[n]` (row = slot * block_tokens + offset). `runs` (`slot_runs(rows)`,
        computed once for all layers) lets whole slots in a row be written as
        slices (one memcpy each) instead of row by row."""
        runs = runs if runs is not None else self.slot_runs(rows)
        for begin, first_slot, count in runs.whole:
            end = begin + count * self.block_tokens
            shape = (count, self.block_tokens, *key.shape[1:])
            self.data[first_slot : first_slot + count, 0, layer] = key[begin:end].view(shape)
            self.data[first_slot : first_slot + count, 1, layer] = value[begin:end].view(shape)
        rest = runs.rest
        if len(rest):
            slots, offsets = rows[rest] // self.block_tokens, rows[rest] % self.block_tokens
            self.data[slots, 0, layer, offsets] = key[rest].to(self.data.dtype)
            self.data[slots, 1, layer, offsets] = value[rest].to(self.data.dtype)

    def write_rows_all_layers(self, rows: torch.Tensor, kv: torch.Tensor, runs: "SlotRuns | None" = None) -> None:
        """Store K/V of every layer, `kv [2, num_layers, n, kv_heads, head_dim]`
        (K then V, the order of a slot's own layout), at flat token rows
        `rows[n]`: `write_rows` for all layers in one copy per run of whole
        slots and one for the other rows."""
        runs = runs if runs is not None else self.slot_runs(rows)
        bt = self.block_tokens
        for begin, first_slot, count in runs.whole:
            part = kv[:, :, begin : begin + count * bt]  # [2, L, count * bt, H, D]
            part = part.reshape(*part.shape[:2], count, bt, *part.shape[3:])
            self.data[first_slot : first_slot + count] = part.permute(2, 0, 1, 3, 4, 5)
        rest = runs.rest
        if len(rest):
            slots, offsets = rows[rest] // bt, rows[rest] % bt
            # advanced indices around two slices: the indexed view is [n, 2, L, H, D]
            self.data[slots, :, :, offsets] = kv[:, :, rest].permute(2, 0, 1, 3, 4).to(self.data.dtype)

    def slot_runs(self, rows: torch.Tensor) -> "SlotRuns":
        """Split `rows` into runs of whole consecutive slots, each given in
        order (offsets 0..block_tokens-1, slot after slot), and the rest."""
        bt = self.block_tokens
        r = np.asarray(rows.numpy() if isinstance(rows, torch.Tensor) else rows, dtype=np.int64)
        whole: list[tuple[int, int, int]] = []
        rest: list[np.ndarray] = []
        for start, first, length in runs(r):  # rows that follow each other, across slots
            head = min((-first) % bt, length)  # rows before the run's first slot boundary
            slots = (length - head) // bt
            if not slots:
                rest.append(np.arange(start, start + length))
                continue
            whole.append((start + head, (first + head) // bt, slots))
            rest += [np.arange(start, start + head), np.arange(start + head + slots * bt, start + length)]
        rest_idx = torch.from_numpy(np.concatenate(rest)) if rest else torch.zeros(0, dtype=torch.int64)
        return SlotRuns(whole, rest_idx)

    def read_rows(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V `[n, kv_heads, head_dim]` of one layer at flat token rows."""
        slots, offsets = rows // self.block_tokens, rows % self.block_tokens
        return self.data[slots, 0, layer, offsets], self.data[slots, 1, layer, offsets]

    def read_rows_all_layers(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V `[n, num_layers, kv_heads, head_dim]` of every layer at flat token rows."""
        slots, offsets = rows // self.block_tokens, rows % self.block_tokens
        return self.data[slots, 0, :, offsets], self.data[slots, 1, :, offsets]

    def slot_keys_on(self, slots: list[int], device: torch.device) -> torch.Tensor:
        """Keys of whole slots, `[n, num_layers, block_tokens, kv_heads,
        head_dim]`, on `device`. From the pinned pool to CUDA: pitched copies
        on the current stream, one per run of consecutive slots, and the host
        never waits (the caller orders that stream after any capture still
        being copied into these slots, `CaptureWriter.order`). Elsewhere a
        host gather, then a copy."""
        if device.type != "cuda" or not self.pinned:
            return self.data[torch.tensor(slots, dtype=torch.int64), 0].to(device)
        out = torch.empty((len(slots), *self.data.shape[2:]), dtype=self.data.dtype, device=device)
        key_bytes = out[0].numel() * out.element_size()
        slot_bytes = self.block_bytes
        stream = torch.cuda.current_stream(device)
        for at, first, n in runs(slots):
            cudart.copy2d_async(out[at].data_ptr(), key_bytes, self.data[first, 0].data_ptr(), slot_bytes,
                                key_bytes, n, stream)
        return out

    def block_keys(self, slot: int) -> torch.Tensor:
        """All keys of one slot, `[num_layers, block_tokens, kv_heads, head_dim]` (a view)."""
        return self.data[slot, 0]


def _unpin(ptr: int) -> None:
    """Undo `register_host` when the pool goes; at interpreter exit CUDA may
    be torn down already, and the process is about to free the memory anyway."""
    try:
        cudart.unregister_host(ptr)
    except RuntimeError:
        pass


def to_device(array: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host array (or CPU tensor) on `device`; on CUDA through pinned memory,
    without synchronizing: code inside the forward pass must never wait for
    the GPU (a plain host->device copy of pageable memory does)."""
    tensor = array if isinstance(array, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
