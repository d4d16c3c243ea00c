"""Captures into an fp8 host tier on CUDA, off the forward's critical path.

`Fp8StreamWriter.write(kv, host_rows)` stores a capture's K/V (`kv [2,
num_layers, n, kv_heads, head_dim]` on the device, keys already at their
virtual positions) at `host_rows` of a page-locked fp8 `HostPool`, enqueuing
everything on one CUDA stream that the caller has ordered after the forward
(`CaptureWriter`). The calling thread never waits for the device:

* whole slots are quantized on the stream (`store.fp8.quantize`, a few slots
  at a time) and their fp8 bytes and parameters copied into the pool;
* rows of an incomplete block are copied, in the model dtype, into the
  block's tail (`HostPool.open_tail`: page-locked, every layer); the write
  that completes a block copies its tail back to the device, quantizes it
  there, once, over all its rows, and copies it into the pool, all on the
  stream, so every copy lands after the ones before it;
* whether each stored block was finite is a flag on the device
  (`take_flags`): the caller reports those flags when the step's report is
  read, and a slot whose flag is False fails (a miss, recomputed; its scales
  are NaN meanwhile, never plausible KV).

Each block is quantized as `HostPool.write_rows_all_layers` quantizes it
(`store.fp8.quantize` over all its rows, once), but always on the device,
where that path quantizes a block completed over several steps on the host.

Contract for the caller: keep `kv` and the tails `write` returns alive until
the stream has passed this write (an event recorded after it); wait for the
stream before any host read of the pool or a tail (`CaptureWriter.settle`);
order device readers of the pool after it (`CaptureWriter.order`).
"""
from __future__ import annotations

import numpy as np
import torch

from vllm_sekv.store import cudart
from vllm_sekv.store.fp8 import quantize_blocks
from vllm_sekv.store.host_pool import QUANTIZE_SCRATCH_BYTES, HostPool
from vllm_sekv.store.slot_runs import runs


class Fp8StreamWriter:
    def __init__(self, pool: HostPool, stream: "torch.cuda.Stream") -> None:
        if pool.scales is None or not pool.pinned:
            raise ValueError("Fp8StreamWriter needs a page-locked fp8 pool")
        self.pool = pool
        self.stream = stream
        self._flags: list[tuple[torch.Tensor, np.ndarray]] = []

    def write(self, kv: torch.Tensor, host_rows: np.ndarray) -> list:
        """Enqueue the store of `kv` at `host_rows` on the stream (call it
        with the stream current); returns the tails it copies into, which the
        caller keeps alive until the stream has passed."""
        pool, bt = self.pool, self.pool.block_tokens
        split = pool.slot_runs(torch.from_numpy(host_rows))
        whole: set[int] = set()
        for begin, first_slot, count in split.whole:
            block = kv[:, :, begin : begin + count * bt]  # [2, L, count * bt, H, D]
            block = block.reshape(*block.shape[:2], count, bt, *block.shape[3:]).permute(2, 0, 1, 3, 4, 5)
            self._store(first_slot, block)
            for slot in range(first_slot, first_slot + count):
                pool.close_tail(slot)  # written whole, every layer
                whole.add(slot)
        by_slot: dict[int, list[tuple[int, int, int]]] = {}
        for begin, host_row, length in runs(host_rows, period=bt):
            slot = host_row // bt
            if slot not in whole:
                by_slot.setdefault(slot, []).append((begin, host_row % bt, length))
        tails = []
        row_bytes = kv[0, 0, 0].numel() * kv.element_size()
        n = kv.shape[2]
        for slot, pieces in by_slot.items():
            tail = pool.open_tail(slot, starts=any(offset == 0 for _, offset, _ in pieces))
            if tail is None:  # its block's earlier rows are gone: failed by the pool
                continue
            tails.append(tail)
            for begin, offset, length in pieces:
                # rows (K or V, layer) are bt rows apart in the tail, n rows apart in the capture
                cudart.copy2d_async(tail.kv.data_ptr() + offset * row_bytes, bt * row_bytes,
                                    kv.data_ptr() + begin * row_bytes, n * row_bytes,
                                    length * row_bytes, 2 * kv.shape[1], self.stream)
                tail.written[:, offset : offset + length] = True
            if tail.written.all():
                pool.close_tail(slot)
                block = tail.kv.to(kv.device, non_blocking=True)  # behind the copies into it, on this stream
                self._store(slot, block[None])
        return tails

    def take_flags(self) -> tuple[torch.Tensor, np.ndarray] | None:
        """`(finite [m] bool on the device, host slot of each)` of every block
        stored since the last call (None: none), joined on the stream."""
        flags, self._flags = self._flags, []
        if not flags:
            return None
        with torch.cuda.stream(self.stream):
            finite = torch.cat([f for f, _ in flags])
        return finite, np.concatenate([s for _, s in flags])

    def _store(self, first_slot: int, block: torch.Tensor) -> None:
        """Quantize `block [m, 2, L, bt, H, D]` on the stream into slots
        `first_slot .. first_slot + m - 1` of the pool, a few at a time."""
        pool = self.pool
        for at, q, params, finite in quantize_blocks(block, QUANTIZE_SCRATCH_BYTES):
            q, params = q.contiguous(), params.contiguous()
            slot = first_slot + at
            for src, dst in ((q, pool.data), (params, pool.scales)):
                nbytes = src.numel() * src.element_size()
                cudart.copy2d_async(dst[slot].data_ptr(), nbytes, src.data_ptr(), nbytes, nbytes, 1, self.stream)
            self._flags.append((finite, np.arange(slot, slot + len(q), dtype=np.int64)))
