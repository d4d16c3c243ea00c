"""Restore pipeline: host pool slots -> paged KV caches, K re-RoPE'd. Pure torch.

Three stages, overlapped batch by batch (`batch_blocks` workspace blocks each):

1. "gather" mode only (the fallback for a pageable pool): host gather
   (`HostGatherer`, CPU threads, blocking) of the scattered host-pool slots into
   one of `num_buffers` pinned staging buffers, one memcpy per run of
   consecutive slots. The default "direct" mode skips this stage;
2. host -> device copy on the pipeline's own copy stream (non-blocking): one
   large copy per batch from the pinned staging buffer ("gather" mode), or one
   copy per run of consecutive slots straight from a pinned pool ("direct"
   mode, no host memcpy; the copy engine does the gather). Measured on the
   H200 machine, 4 MiB torch copies from scattered pinned slots reach 96-97%
   of one large copy's bandwidth, and a native loop of cudaMemcpyAsync was no
   faster (benchmarks/results/gpu/RESULTS.md), so there is no native code here;
3. scatter + re-RoPE (`vllm_sekv.ops.scatter_rerope`) on the caller's current
   (compute) stream, after a CUDA event of stage 2.

Buffers are reused round-robin: stage 1 of batch i waits on the host for the
copy that last read its pinned buffer (i - num_buffers); stage 2 waits, on the
copy stream, for the scatter that last read its device buffer. So batch i's
copy overlaps batch i-1's scatter (and, in gather mode, batch i+1's gather).
With a `device_buffer` (the GPU block pool) the copies land in its rows and
the scatter reads them there; the device staging ring is then unused.

On CPU (device "cpu") the same code runs without streams: gather, plain copy,
reference scatter. `restore` is then fully synchronous.

What each call mutates: the destination caches (at the given slots, on the
compute stream), the pipeline's staging buffers, and, when a `device_buffer`
is given (the GPU block pool), its rows `device_rows`. The host pool is read:
in "gather" mode only until `restore` returns; in "direct" mode until the
returned handle completes (do not overwrite those slots before `handle.wait()`
or a stream wait on `handle.event`). Bad arguments raise ValueError before any
work is enqueued. No vLLM imports.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from vllm_sekv import ops
from vllm_sekv.store import cudart
from vllm_sekv.triton_kernels.rope.reference import RopeSpec

GATHER_MODES = ("gather", "direct")


def coalesce_runs(src: Sequence[int], dst: Sequence[int] | None = None) -> list[tuple[int, int, int]]:
    """Merge (src[i], dst[i]) pairs into runs `(src_start, dst_start, length)` where
    both sides advance by one. `dst` defaults to 0, 1, 2, ..."""
    runs: list[tuple[int, int, int]] = []
    for i, s in enumerate(src):
        d = i if dst is None else dst[i]
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((int(s), int(d), 1))
    return runs


class HostGatherer:
    """Copies scattered rows of a host tensor into a staging tensor with threads.

    `gather` is blocking and may run on any thread. Each piece is one plain
    memcpy (numpy's copy of a byte view, which releases the GIL and, unlike
    torch's CPU copy, starts no intra-op thread team of its own), so
    `num_threads` copies proceed in parallel. Mutates only `out`.
    """

    def __init__(self, num_threads: int = 4) -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self.num_threads = num_threads
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="sekv-gather") if num_threads > 1 else None

    def gather(self, pool: torch.Tensor, slots: Sequence[int], out: torch.Tensor) -> None:
        """out[i] = pool[slots[i]] for i < len(slots)."""
        if len(slots) > out.shape[0]:
            raise ValueError(f"{len(slots)} slots do not fit staging of {out.shape[0]} rows")
        runs = coalesce_runs(slots)
        # Split long runs so that the threads get even shares.
        share = max(1, -(-len(slots) // self.num_threads))
        pieces = [(s + o, d + o, min(share, n - o)) for s, d, n in runs for o in range(0, n, share)]
        if self._executor is None or len(pieces) == 1:
            _copy_pieces(pool, out, pieces)
            return
        chunks = [pieces[i::self.num_threads] for i in range(self.num_threads)]
        futures = [self._executor.submit(_copy_pieces, pool, out, c) for c in chunks if c]
        for f in futures:
            f.result()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)


def _byte_rows(t: torch.Tensor):
    """numpy uint8 view [rows, row_bytes] of a contiguous CPU tensor (no copy)."""
    return t.reshape(t.shape[0], -1).view(torch.uint8).numpy()


def _copy_pieces(pool: torch.Tensor, out: torch.Tensor, pieces: list[tuple[int, int, int]]) -> None:
    if pool.device.type == "cpu" and out.device.type == "cpu" and pool.is_contiguous() and out.is_contiguous():
        src, dst = _byte_rows(pool), _byte_rows(out)
        for s, d, n in pieces:
            np.copyto(dst[d:d + n], src[s:s + n])
        return
    for s, d, n in pieces:
        out[d:d + n].copy_(pool[s:s + n])


@dataclass
class RestoreHandle:
    """Completion of one `restore`. `event` is recorded on the compute stream after
    the last scatter (None on CPU, where the work is already done)."""

    event: torch.cuda.Event | None
    num_blocks: int
    num_bytes: int

    def wait(self) -> None:
        """Block the calling thread until the restore has finished on the device."""
        if self.event is not None:
            self.event.synchronize()

    def ready(self) -> bool:
        return self.event is None or self.event.query()


class RestorePipeline:
    """Batched, overlapped restore of host-pool blocks into paged KV caches.

    block_shape: one host-pool slot, `[2, num_layers, block_tokens, kv_heads,
    head_dim]`; dtype: the pool's dtype; device: "cpu" or a CUDA device.
    Allocates `num_buffers` device staging buffers and (gather mode, CUDA)
    `num_buffers` pinned host buffers of `batch_blocks` slots each.
    One pipeline per worker; `restore` calls must come from one thread.
    Default "direct": measured fastest on the H200 machine (see
    benchmarks/results/gpu/); it needs a pinned pool and falls back to
    "gather" for a pageable one.
    """

    def __init__(self, block_shape: Sequence[int], dtype: torch.dtype, device: torch.device | str,
                 batch_blocks: int = 64, num_buffers: int = 2, num_threads: int = 4,
                 mode: str = "direct") -> None:
        if len(block_shape) != 5 or block_shape[0] != 2:
            raise ValueError(f"block_shape must be [2, layers, block_tokens, kv_heads, head_dim], got {block_shape}")
        if mode not in GATHER_MODES:
            raise ValueError(f"mode must be one of {GATHER_MODES}, got {mode!r}")
        if batch_blocks < 1 or num_buffers < 1:
            raise ValueError("batch_blocks and num_buffers must be >= 1")
        self.block_shape = tuple(int(x) for x in block_shape)
        self.block_tokens = self.block_shape[2]
        self.dtype = dtype
        self.device = torch.device(device)
        self.batch_blocks = batch_blocks
        self.mode = mode
        self.gatherer = HostGatherer(num_threads)
        self.is_cuda = self.device.type == "cuda"
        shape = (batch_blocks, *self.block_shape)
        self._dev = [torch.empty(shape, dtype=dtype, device=self.device) for _ in range(num_buffers)]
        self._host: list[torch.Tensor | None] = [None] * num_buffers  # pinned, allocated on first use
        if self.is_cuda:
            self.copy_stream = torch.cuda.Stream(device=self.device)
            self._h2d_done = [None] * num_buffers
            self._scatter_done = [None] * num_buffers

    def _host_buffer(self, buf: int) -> torch.Tensor:
        if self._host[buf] is None:
            shape = (self.batch_blocks, *self.block_shape)
            self._host[buf] = torch.empty(shape, dtype=self.dtype, pin_memory=self.is_cuda)
        return self._host[buf]

    @property
    def block_bytes(self) -> int:
        return self._dev[0][0].numel() * self._dev[0].element_size()

    def restore(
        self,
        pool: torch.Tensor,
        host_slots: Sequence[int],
        key_caches: Sequence[torch.Tensor],
        value_caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
        delta_positions: torch.Tensor,
        rope: RopeSpec,
        device_buffer: torch.Tensor | None = None,
        device_rows: Sequence[int] | None = None,
        write: "Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None" = None,
    ) -> RestoreHandle:
        """Restore blocks `pool[host_slots[j]]` (j-th block = batch tokens
        `[j*block_tokens, (j+1)*block_tokens)`) into the caches at `slot_mapping`,
        K rotated by `delta_positions`; both are `[len(host_slots) * block_tokens]`.

        `write(staged_blocks, slot_mapping, delta_positions)`, if given, replaces
        stage 3 (e.g. the platform's own cache-update op per layer); it is called
        per batch on the compute stream with the batch's staged blocks
        `[m, 2, layers, block_tokens, kv_heads, head_dim]` on the device, and
        `key_caches` / `value_caches` are then unused.

        Non-blocking on CUDA apart from the host gather (gather mode) and waits
        for pinned buffers still being copied; returns a handle whose event
        marks completion on the current stream. If `device_buffer` (e.g.
        `GpuBlockPool.data`) and `device_rows` are given, each block is also
        left in `device_buffer[device_rows[j]]` (the copy lands there).
        """
        n = len(host_slots)
        if tuple(pool.shape[1:]) != self.block_shape or pool.dtype != self.dtype:
            raise ValueError(f"pool {tuple(pool.shape)} {pool.dtype} does not match {self.block_shape} {self.dtype}")
        if slot_mapping.shape != (n * self.block_tokens,) or delta_positions.shape != (n * self.block_tokens,):
            raise ValueError(f"slot_mapping / delta_positions must be [{n * self.block_tokens}]")
        if (device_buffer is None) != (device_rows is None) or (device_rows is not None and len(device_rows) != n):
            raise ValueError("device_buffer and device_rows go together, one row per block")
        if any(not 0 <= s < pool.shape[0] for s in host_slots):
            raise ValueError("host slot out of range")
        slots_dev = slot_mapping.to(self.device, torch.int64)
        deltas_dev = delta_positions.to(self.device, torch.int64)
        if not self.is_cuda:
            return self._restore_cpu(pool, host_slots, key_caches, value_caches, slots_dev, deltas_dev, rope,
                                     device_buffer, device_rows)
        direct = self.mode == "direct" and cudart.is_page_locked(pool)
        compute = torch.cuda.current_stream(self.device)
        # Rows of device_buffer may still be read by earlier compute work.
        self.copy_stream.wait_stream(compute)
        bt = self.block_tokens
        for i, b0 in enumerate(range(0, n, self.batch_blocks)):
            b1 = min(n, b0 + self.batch_blocks)
            buf = i % len(self._dev)
            batch_slots = host_slots[b0:b1]
            rows = None if device_rows is None else list(device_rows[b0:b1])
            if not direct:
                if self._h2d_done[buf] is not None:
                    self._h2d_done[buf].synchronize()  # pinned buffer still being read
                self.gatherer.gather(pool, batch_slots, self._host_buffer(buf))
            with torch.cuda.stream(self.copy_stream):
                if self._scatter_done[buf] is not None:
                    self.copy_stream.wait_event(self._scatter_done[buf])
                target = self._dev[buf] if rows is None else device_buffer
                dst_rows = list(range(b1 - b0)) if rows is None else rows
                if direct:
                    for s, d, m in coalesce_runs(batch_slots, dst_rows):
                        target[d:d + m].copy_(pool[s:s + m], non_blocking=True)
                else:
                    for s, d, m in coalesce_runs(range(b1 - b0), dst_rows):
                        target[d:d + m].copy_(self._host[buf][s:s + m], non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.copy_stream)
                self._h2d_done[buf] = done
            compute.wait_event(done)
            src_rows = None if rows is None else torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
            if write is not None:
                staged = self._dev[buf][:b1 - b0] if rows is None else target[src_rows]
                write(staged, slots_dev[b0 * bt:b1 * bt], deltas_dev[b0 * bt:b1 * bt])
            else:
                ops.scatter_rerope(target if rows is not None else self._dev[buf][:b1 - b0], key_caches,
                                   value_caches, slots_dev[b0 * bt:b1 * bt], deltas_dev[b0 * bt:b1 * bt], rope,
                                   src_rows=src_rows)
            ev = torch.cuda.Event()
            ev.record(compute)
            self._scatter_done[buf] = ev
        end = torch.cuda.Event()
        end.record(compute)
        return RestoreHandle(end, n, n * self.block_bytes)

    def _restore_cpu(self, pool, host_slots, key_caches, value_caches, slots, deltas, rope,
                     device_buffer, device_rows) -> RestoreHandle:
        bt = self.block_tokens
        for b0 in range(0, len(host_slots), self.batch_blocks):
            b1 = min(len(host_slots), b0 + self.batch_blocks)
            staging = self._host_buffer(0)[:b1 - b0]
            self.gatherer.gather(pool, host_slots[b0:b1], staging)
            if device_buffer is not None:
                device_buffer[torch.tensor(list(device_rows[b0:b1]))] = staging.to(device_buffer.device)
            ops.scatter_rerope(staging, key_caches, value_caches, slots[b0 * bt:b1 * bt], deltas[b0 * bt:b1 * bt],
                               rope)
        return RestoreHandle(None, len(host_slots), len(host_slots) * self.block_bytes)

    def scatter_resident(self, device_buffer: torch.Tensor, rows: Sequence[int], key_caches: Sequence[torch.Tensor],
                         value_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor,
                         delta_positions: torch.Tensor, rope: RopeSpec) -> None:
        """Scatter + re-RoPE blocks already on the device (`device_buffer[rows[j]]`,
        e.g. GPU-pool hits) on the current stream. Non-blocking; mutates the caches."""
        if not rows:
            return
        src_rows = torch.tensor(list(rows), dtype=torch.int64).to(device_buffer.device, non_blocking=True)
        ops.scatter_rerope(device_buffer, key_caches, value_caches, slot_mapping.to(device_buffer.device),
                           delta_positions.to(device_buffer.device), rope, src_rows=src_rows)

    def close(self) -> None:
        self.gatherer.close()
