"""Restore pipeline: host pool slots -> paged KV caches, K re-RoPE'd. Pure torch.

Two stages, overlapped batch by batch (`batch_blocks` workspace blocks each):

1. host -> device copy on the pipeline's own copy stream (non-blocking), one
   copy per run of consecutive slots straight from the pinned pool into one
   of `num_buffers` device staging buffers (the copy engine does the gather;
   scattered 4 MiB copies from pinned slots reach nearly the bandwidth of one
   large copy, so there is no host gather and no native code);
2. scatter + re-RoPE (`vllm_sekv.ops.scatter_rerope`, every layer in one
   launch), or the caller's `write`, on the caller's current (compute)
   stream, after a CUDA event of stage 1.

Buffers are reused round-robin: the copy into a device buffer waits, on the
copy stream, for the scatter that last read it, so batch i's copy overlaps
batch i-1's scatter.

On CPU (device "cpu") the same code runs without streams: a threaded host
gather (`HostGatherer`) into a staging buffer, then the reference scatter.
`restore` is then fully synchronous.

An fp8 pool (`workspace_codec` fp8, dtype float8_e4m3fn): the staging
buffers hold its fp8 bytes (half of an exact pool's), and `restore` takes the
pool's `scales`; each batch's parameters `[m, 2, layers, kv_heads, 1 +
head_dim]` (an eighth of the blocks' fp8 bytes at 32 tokens a block; on CUDA
copied from the pinned pool beside the bytes, one copy per run of slots) go
to the device and are handed to
the scatter (`ops.scatter_rerope(..., scales=)`) or to `write` as a fourth
argument, which dequantize there.

Given `resident` (`store.resident.ResidentBlocks`, a diff restore), blocks
kept on the device take no host copy, and moved ones are kept for later
restores (the handle counts both). Two ways:

* placed (no `write` and an exact pool: the pipeline's own scatter into
  `key_caches` / `value_caches`): the restore is planned as a whole; its
  resident blocks are written straight from `resident.data` by one scatter
  launch (`src_rows`: their entries), on the compute stream before the first
  batch, with no staging; the moved blocks go in batches as above, one
  scatter over each batch's staging rows. A restore of resident blocks only
  copies nothing to the device but its index arrays;
* staged (a `write`, or an fp8 pool, whose scales come from the host batch
  by batch): a batch's staging holds its moved blocks first, then its
  resident ones, copied there on the device (copy stream), and the batch's
  slot mapping and deltas are permuted to match.

`resident.data` on CUDA: admits (`index_copy_` from staging rows) write its
entries on the copy stream; staged restores read them there too, placed
ones on the compute stream. Within a restore no entry is both read and
written: a host slot appears once in a restore, and `ResidentBlocks.plan`
never hands a moved block the entry of a slot the restore holds (`keep`), so
every entry a restore reads was admitted by an earlier one. Read after
write: the placement launch waits for an event the copy stream records after
the restore's index arrays, behind every copy-stream write of earlier
restores. Write after read: a restore's copy stream waits for the compute
stream, and for the last placement launch (should the current stream have
changed), before its first admit.

What each call mutates: the destination caches (at the given slots, on the
compute stream), the pipeline's staging buffers, and `resident`'s entries.
The host pool is read until the returned handle completes (do not overwrite
those slots before `handle.wait()` or a stream wait on `handle.event`). Bad arguments raise
ValueError before any work is enqueued. No vLLM imports.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from vllm_sekv import ops
from vllm_sekv.store import cudart
from vllm_sekv.store.host_pool import to_device
from vllm_sekv.store.resident import ResidentBlocks
from vllm_sekv.store.slot_runs import runs
from vllm_sekv.ops import RopeSpec


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
        # Split long runs so that the threads get even shares.
        share = max(1, -(-len(slots) // self.num_threads))
        pieces = [(s + o, d + o, min(share, n - o)) for d, s, n in runs(slots) for o in range(0, n, share)]
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
    num_bytes: int  # host -> device
    placed_blocks: int = 0  # copied from the device's resident blocks instead

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
    Allocates `num_buffers` device staging buffers of `batch_blocks` slots
    each (and on CPU one host staging buffer). On CUDA the pool must be
    page-locked (the worker's host tier is). One pipeline per worker;
    `restore` calls must come from one thread.
    """

    def __init__(self, block_shape: Sequence[int], dtype: torch.dtype, device: torch.device | str,
                 batch_blocks: int = 64, num_buffers: int = 2, num_threads: int = 4) -> None:
        if len(block_shape) != 5 or block_shape[0] != 2:
            raise ValueError(f"block_shape must be [2, layers, block_tokens, kv_heads, head_dim], got {block_shape}")
        if batch_blocks < 1 or num_buffers < 1:
            raise ValueError("batch_blocks and num_buffers must be >= 1")
        self.block_shape = tuple(int(x) for x in block_shape)
        self.block_tokens = self.block_shape[2]
        self.dtype = dtype
        self.device = torch.device(device)
        self.batch_blocks = batch_blocks
        self.is_cuda = self.device.type == "cuda"
        shape = (batch_blocks, *self.block_shape)
        self._dev = [torch.empty(shape, dtype=dtype, device=self.device) for _ in range(num_buffers)]
        # fp8 staging: each block's float32 parameters [2, layers, kv_heads, 1 + head_dim] move with it
        _, layers, _, heads, head_dim = self.block_shape
        self.scale_bytes = 2 * layers * heads * (1 + head_dim) * 4 if dtype == torch.float8_e4m3fn else 0
        # CUDA fp8: each staging buffer's parameters, copied beside its bytes (no host gather)
        self._params = [torch.empty((batch_blocks, 2, layers, heads, 1 + head_dim), dtype=torch.float32,
                                    device=self.device) for _ in range(num_buffers)] \
            if self.scale_bytes and self.is_cuda else []
        if self.is_cuda:
            self.copy_stream = torch.cuda.Stream(device=self.device)
            self._scatter_done: list[torch.cuda.Event | None] = [None] * num_buffers
            self._placed_read: torch.cuda.Event | None = None  # after the last launch that read `resident.data`
            self.gatherer = None
        else:
            self.gatherer = HostGatherer(num_threads)

    @property
    def block_bytes(self) -> int:
        """Bytes one block moves host -> device (its scales included)."""
        return self._dev[0][0].numel() * self._dev[0].element_size() + self.scale_bytes

    def restore(
        self,
        pool: torch.Tensor,
        host_slots: Sequence[int],
        key_caches: Sequence[torch.Tensor],
        value_caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
        delta_positions: torch.Tensor | None,
        rope: RopeSpec,
        write: "Callable[..., None] | None" = None,
        scales: torch.Tensor | None = None,
        resident: ResidentBlocks | None = None,
    ) -> RestoreHandle:
        """Restore blocks `pool[host_slots[j]]` (j-th block = batch tokens
        `[j*block_tokens, (j+1)*block_tokens)`) into the caches at `slot_mapping`,
        K rotated by `delta_positions`; both are `[len(host_slots) * block_tokens]`
        (`delta_positions` None: keys are not moved, copied as they are).

        `write(staged_blocks, slot_mapping, delta_positions)`, if given, replaces
        stage 2 (e.g. the platform's own cache-update op per layer); it is called
        per batch on the compute stream with the batch's staged blocks
        `[m, 2, layers, block_tokens, kv_heads, head_dim]` on the device, and
        `key_caches` / `value_caches` are then unused.

        `scales` (an fp8 pool's `[slots, 2, layers, kv_heads, 1 + head_dim]` float32, required
        exactly when the pool is fp8): `write` then gets the batch's scales as
        a fourth argument.

        `resident`: blocks kept on the device (module doc: placed without a
        `write` from an exact pool, else staged); `host_slots` must then be
        distinct.

        Non-blocking on CUDA; returns a handle whose event marks completion on
        the current stream. The pool's slots are read until then.
        """
        n = len(host_slots)
        if tuple(pool.shape[1:]) != self.block_shape or pool.dtype != self.dtype:
            raise ValueError(f"pool {tuple(pool.shape)} {pool.dtype} does not match {self.block_shape} {self.dtype}")
        if (scales is not None) != bool(self.scale_bytes):
            raise ValueError("scales are required with an fp8 pool, and only with one")
        tokens = (n * self.block_tokens,)
        if slot_mapping.shape != tokens or (delta_positions is not None and delta_positions.shape != tokens):
            raise ValueError(f"slot_mapping / delta_positions must be [{n * self.block_tokens}]")
        if any(not 0 <= s < pool.shape[0] for s in host_slots):
            raise ValueError("host slot out of range")
        slots_dev = slot_mapping.to(self.device, torch.int64)
        deltas_dev = None if delta_positions is None else delta_positions.to(self.device, torch.int64)
        keep = set(host_slots) if resident is not None else set()  # what the restore reads from `resident`
        if resident is not None and len(keep) != n:
            raise ValueError("a restore with resident blocks takes distinct host slots")
        place = resident is not None and write is None and scales is None  # resident blocks written in place
        if not self.is_cuda:
            return self._restore_cpu(pool, host_slots, key_caches, value_caches, slots_dev, deltas_dev, rope, write,
                                     scales, resident, keep, place)
        if not cudart.is_page_locked(pool):
            raise ValueError("a CUDA restore reads a page-locked (pinned) host pool")
        compute = torch.cuda.current_stream(self.device)
        # The copies follow what the compute stream was told to wait for (the
        # captures that wrote these slots, `CaptureWriter.order`), and the
        # admits below follow the reads of the entries they overwrite.
        self.copy_stream.wait_stream(compute)
        if self._placed_read is not None:
            self.copy_stream.wait_event(self._placed_read)
        with torch.cuda.stream(self.copy_stream):  # the batches' index arrays: copied there, read on both
            batches = _plan(host_slots, self.batch_blocks, self.block_tokens, resident, keep, self.device, place,
                            also_read_on=compute)
            planned = torch.cuda.Event() if place else None
            if planned is not None:  # behind every earlier admit (module doc)
                planned.record(self.copy_stream)
        moved = placed = staged_batches = 0
        for batch in batches:
            if batch.in_place:
                compute.wait_event(planned)
                self._place(batch, resident, key_caches, value_caches, slots_dev, deltas_dev, rope)
                self._placed_read = torch.cuda.Event()
                self._placed_read.record(compute)
                placed += batch.num_placed
                continue
            buf = staged_batches % len(self._dev)
            staged_batches += 1
            staged = self._dev[buf][:len(batch.slots)]
            with torch.cuda.stream(self.copy_stream):
                if self._scatter_done[buf] is not None:  # the scatter that last read this buffer
                    self.copy_stream.wait_event(self._scatter_done[buf])
                for d, s, m in runs(batch.moved_slots):
                    staged[d:d + m].copy_(pool[s:s + m], non_blocking=True)
                batch.keep(staged, resident)
                batch_scales = None
                if scales is not None:  # every block's, resident ones too: from the pinned host tensor
                    batch_scales = self._params[buf][:len(batch.slots)]
                    for d, s, m in runs(batch.slots):
                        batch_scales[d:d + m].copy_(scales[s:s + m], non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.copy_stream)
            compute.wait_event(done)
            batch_slots, batch_deltas = batch.tokens(slots_dev, deltas_dev, self.block_tokens)
            self._write(staged, key_caches, value_caches, batch_slots, batch_deltas, rope, write, batch_scales)
            ev = torch.cuda.Event()
            ev.record(compute)
            self._scatter_done[buf] = ev
            moved, placed = moved + len(batch.moved_slots), placed + batch.num_placed
        end = torch.cuda.Event()
        end.record(compute)
        return RestoreHandle(end, n, moved * self.block_bytes + placed * self.scale_bytes, placed)

    @staticmethod
    def _write(staged, key_caches, value_caches, slots, deltas, rope, write, scales) -> None:
        if write is not None:
            if scales is None:
                write(staged, slots, deltas)
            else:
                write(staged, slots, deltas, scales)
        else:
            ops.scatter_rerope(staged, key_caches, value_caches, slots, deltas, rope, scales=scales)

    def _place(self, batch: "_Batch", resident: ResidentBlocks, key_caches, value_caches, slots, deltas,
               rope) -> None:
        """Write a batch of resident blocks straight from `resident.data` (one
        scatter launch, its entries as the source rows; current stream)."""
        batch_slots, batch_deltas = batch.tokens(slots, deltas, self.block_tokens)
        ops.scatter_rerope(resident.data, key_caches, value_caches, batch_slots, batch_deltas, rope,
                           src_rows=batch.placed_index)

    def _restore_cpu(self, pool, host_slots, key_caches, value_caches, slots, deltas, rope, write,
                     scales, resident, keep, place) -> RestoreHandle:
        moved = placed = 0
        for batch in _plan(host_slots, self.batch_blocks, self.block_tokens, resident, keep, self.device, place):
            if batch.in_place:
                self._place(batch, resident, key_caches, value_caches, slots, deltas, rope)
                placed += batch.num_placed
                continue
            staging = self._dev[0][:len(batch.slots)]
            self.gatherer.gather(pool, batch.moved_slots, staging)
            batch.keep(staging, resident)
            batch_scales = None
            if scales is not None:
                batch_scales = scales[torch.as_tensor(batch.slots, dtype=torch.int64)]
            batch_slots, batch_deltas = batch.tokens(slots, deltas, self.block_tokens)
            self._write(staging, key_caches, value_caches, batch_slots, batch_deltas, rope, write, batch_scales)
            moved, placed = moved + len(batch.moved_slots), placed + batch.num_placed
        return RestoreHandle(None, len(host_slots), moved * self.block_bytes + placed * self.scale_bytes, placed)

    def close(self) -> None:
        if self.gatherer is not None:
            self.gatherer.close()


@dataclass
class _Batch:
    """One batch of a restore in staging order: its moved blocks first
    (copied from the host into staging rows 0..), then its resident ones.
    Staged (`_plan` without `place`) those are copied on the device into the
    staging rows after the moved ones; placed, a batch holds moved blocks
    only, or resident ones only, written from `resident.data` itself
    (`in_place`).

    `blocks`: the restore's indices of its blocks, in staging order. Its
    index arrays on the device (`_plan` moves every batch's in one copy):
    `placed_index` (the resident entries to read), `admit_index` (the entries
    that keep its first moved blocks), `token_rows` (the restore's token rows
    of `blocks`; None when they are one range in order)."""

    blocks: np.ndarray
    slots: list[int]  # host slots in staging order
    num_moved: int
    placed_entries: list[int]  # entries of blocks[num_moved:]
    admit_entries: list[int]  # entries for blocks[:len(admit_entries)]
    in_place: bool = False  # resident blocks only, written from `resident.data` itself
    placed_index: torch.Tensor | None = None
    admit_index: torch.Tensor | None = None
    token_rows: torch.Tensor | None = None

    @classmethod
    def staged(cls, host_slots: Sequence[int], b0: int, b1: int, resident: ResidentBlocks | None,
               keep: set[int]) -> "_Batch":
        """The restore's blocks `[b0, b1)`, their resident ones staged after the moved ones."""
        slots = [int(s) for s in host_slots[b0:b1]]
        if resident is None:
            return cls(np.arange(b0, b1), slots, len(slots), [], [])
        plan = resident.plan(slots, keep=keep)
        order = plan.moved + [i for i, _ in plan.placed]
        return cls(b0 + np.asarray(order, dtype=np.int64), [slots[i] for i in order], len(plan.moved),
                   [e for _, e in plan.placed], [e for _, e in plan.admit])

    @classmethod
    def placed_apart(cls, host_slots: Sequence[int], batch_blocks: int, resident: ResidentBlocks,
                     keep: set[int]) -> list["_Batch"]:
        """A restore planned as a whole: one batch of all its resident blocks
        (first; none without any), then its moved ones, `batch_blocks` at a time."""
        slots = [int(s) for s in host_slots]
        plan = resident.plan(slots, keep=keep)
        batches = []
        if plan.placed:
            blocks = np.asarray([i for i, _ in plan.placed], dtype=np.int64)
            batches.append(cls(blocks, [slots[i] for i in blocks], 0, [e for _, e in plan.placed], [], True))
        admitted = dict(plan.admit)  # the first moved blocks (as many as entries could be had)
        for c in range(0, len(plan.moved), batch_blocks):
            chunk = plan.moved[c:c + batch_blocks]
            batches.append(cls(np.asarray(chunk, dtype=np.int64), [slots[i] for i in chunk], len(chunk), [],
                               [admitted[i] for i in chunk if i in admitted]))
        return batches

    @property
    def moved_slots(self) -> list[int]:
        return self.slots[:self.num_moved]

    @property
    def num_placed(self) -> int:
        return len(self.placed_entries)

    def host_indices(self, block_tokens: int) -> list[np.ndarray]:
        """`placed_index`, `admit_index` and `token_rows` as host arrays (empty: none)."""
        b = self.blocks
        in_order = len(b) == 0 or bool((b == np.arange(b[0], b[0] + len(b))).all())
        rows = np.empty(0, dtype=np.int64) if in_order else \
            (b[:, None] * block_tokens + np.arange(block_tokens)[None, :]).reshape(-1)
        return [np.asarray(self.placed_entries, dtype=np.int64), np.asarray(self.admit_entries, dtype=np.int64), rows]

    def keep(self, staged: torch.Tensor, resident: ResidentBlocks | None) -> None:
        """Fill the resident blocks' staging rows from the device and keep the
        admitted moved ones there (after their host copies, on the current
        stream)."""
        if resident is None:
            return
        m = self.num_moved
        kept, rows = resident.data.view(torch.uint8), staged.view(torch.uint8)  # any dtype, fp8 included
        if self.placed_entries:
            torch.index_select(kept, 0, self.placed_index, out=rows[m:m + len(self.placed_entries)])
        if self.admit_entries:
            kept.index_copy_(0, self.admit_index, rows[:len(self.admit_entries)])

    def tokens(self, slot_mapping: torch.Tensor, deltas: torch.Tensor | None,
               block_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The batch's slot mapping and deltas (None: None), in staging order."""
        if self.token_rows is None:
            lo = int(self.blocks[0]) * block_tokens
            hi = lo + len(self.blocks) * block_tokens
            return slot_mapping[lo:hi], None if deltas is None else deltas[lo:hi]
        rows = self.token_rows
        return slot_mapping.index_select(0, rows), None if deltas is None else deltas.index_select(0, rows)


def _plan(host_slots: Sequence[int], batch_blocks: int, block_tokens: int, resident: ResidentBlocks | None,
          keep: set[int], device: torch.device, place: bool = False,
          also_read_on: "torch.cuda.Stream | None" = None) -> list[_Batch]:
    """A restore's batches, in order: `_Batch.placed_apart` with `resident`
    and `place`, else `_Batch.staged` ones of `batch_blocks`. With `resident`
    every batch is planned up front (host bookkeeping: a batch's plan depends
    on the plans before it, never on their copies) and all their index arrays
    go to the device in one copy, on the current stream, each array at a
    16-byte boundary (the scatter kernel specializes on pointer alignment);
    `also_read_on`: another stream that reads them (their memory is not
    reused before its reads). Not one copy per batch and array: each goes
    through a pinned staging buffer, a host cost per batch on the path that
    must only enqueue."""
    n = len(host_slots)
    if resident is not None and place:
        batches = _Batch.placed_apart(host_slots, batch_blocks, resident, keep)
    else:
        batches = [_Batch.staged(host_slots, b0, min(n, b0 + batch_blocks), resident, keep)
                   for b0 in range(0, n, batch_blocks)]
    if resident is None:
        return batches
    per_batch = [batch.host_indices(block_tokens) for batch in batches]
    pieces, spans, at = [], [], 0
    for a in (a for arrays in per_batch for a in arrays):
        spans.append((at, len(a)))
        pad = -len(a) % 2  # int64: an even start is a 16-byte one
        pieces += [a, np.zeros(pad, dtype=np.int64)]
        at += len(a) + pad
    if not at:
        return batches
    flat = to_device(np.concatenate(pieces), device)
    if also_read_on is not None:
        flat.record_stream(also_read_on)
    views = iter([flat[lo:lo + m] if m else None for lo, m in spans])
    for batch in batches:
        batch.placed_index, batch.admit_index, batch.token_rows = next(views), next(views), next(views)
    return batches
