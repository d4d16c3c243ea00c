"""A step's captured K/V: gathered layer by layer on the device, stored into
the host tier once the forward is done.

`StepCapture` holds the planned rows of one forward's batch for every layer in
one device buffer `[2, num_layers, n, kv_heads, head_dim]` (K then V), the
row layout of a host slot, filled one of two ways:

* layer by layer inside the forward: `take(layer, key, value)` gathers a
  layer's batch rows (two `index_select`s, no allocation, no
  synchronization); the attention hook calls it once per layer;
* from an fp8 paged cache, layer by layer inside the forward
  (`cache_bytes=True`, rows are paged slots): `take_bytes(layer, keys,
  values)` reads the bytes the platform just wrote through uint8 views of
  the layer's cache (`compat.paged_kv_byte_views`): a pool over an fp8 cache
  stores them as they are (`HostPool.write_fp8_rows`);
* where the worker can read the paged caches directly (CUDA, vLLM's
  FlashAttention layout; `paged=True`, rows are paged slots): once after the
  forward, `gather(key_caches, value_caches, rope)`, one launch for every
  layer with the keys' rotation fused in (`ops.gather_rerope`). A decode step
  then pays no per-layer capture work inside the forward. The views of the
  caches are checked once against what the attention layer wrote (`expect`)
  before the worker trusts them.

`CaptureWriter.write(capture, rope)` rotates the keys to their virtual
positions and stores the buffer at the capture's host rows:

* CUDA, pool page-locked, libcudart found: asynchronously. A side stream waits
  for the forward, then one pitched device->host copy per run of consecutive
  rows inside one slot lands every layer's K and V of those rows straight in
  the pool (`2 * num_layers` rows of `run * kv_heads * head_dim` elements,
  `block_tokens * kv_heads * head_dim` apart). The calling thread never waits:
  a decode step no longer pays a device synchronization and a host-side copy.
  `settle()` waits for the copies; it must be called before anything reads or
  rewrites those host rows on the host (the worker calls it at the start of a
  step that does, and at shutdown), and it costs nothing once the copies are
  done. A reader on the device (a restore's copies, a GPU index update)
  instead orders its stream after them with `order(stream)`, and the step
  calls `reap()`, which never waits: under asynchronous scheduling the next
  step starts while this one's forward still runs, and waiting there would
  undo the overlap.
* The same with an fp8 pool (`workspace_codec` fp8): the side stream
  quantizes whole slots and completed blocks on the device and copies their
  fp8 bytes and parameters into the pool, and the rows of incomplete blocks
  into their page-locked tails (`store.fp8_capture`). Whether each stored
  block was finite comes back as flags on the device (`take_flags`), which
  the step's report reads later (a block that was not fails its slot).
* The same with a pool over an fp8 paged cache (`HostPool.layer_params`):
  the capture's bytes are copied as an exact pool's rows are (model-dtype
  rows are first rounded to the layer scales where they are), and the slots
  take the fixed parameters on the host.
* Elsewhere: synchronously (`HostPool.write_rows_all_layers`; under fp8 the
  pool fails a non-finite block's slot at once, `take_failed_slots`).

Keys a capture moves (`deltas`) are rotated in the buffer's dtype; a
capture of cache bytes moves none (rows that move are captured from the
attention layer's K/V and rounded once, after the rotation).

A capture that did not see every layer is never written: `write` returns
False and the caller fails its slots (never store a partial block).
"""
from __future__ import annotations

import numpy as np
import torch

from vllm_sekv.ops import gather_rerope, rotate_keys, rotate_layer_keys_
from vllm_sekv.store import cudart
from vllm_sekv.store.fp8 import quantize_with
from vllm_sekv.store.fp8_capture import Fp8StreamWriter
from vllm_sekv.store.host_pool import HostPool
from vllm_sekv.store.slot_runs import runs


class StepCapture:
    """One forward's planned rows, captured from every layer."""

    def __init__(self, rows: torch.Tensor, host_rows: np.ndarray, deltas: torch.Tensor | None,
                 num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, paged: bool = False,
                 cache_bytes: bool = False) -> None:
        """`rows [n]` (on the forward's device): the batch rows to keep (`take`),
        or with `paged` or `cache_bytes` their paged-cache slots (`gather`,
        `take_bytes`; the buffer then holds uint8); `host_rows [n]`: where
        they go; `deltas [n]` (same device, or None): virtual position minus
        computed position of each row's key."""
        self.rows = rows
        self.paged = paged
        self.cache_bytes = cache_bytes
        self.host_rows = host_rows
        self.deltas = deltas
        self.kv = torch.empty((2, num_layers, len(host_rows), kv_heads, head_dim),
                              dtype=torch.uint8 if cache_bytes else dtype, device=rows.device)
        self._layer_views: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]] | None = None  # for `take`
        self._missing = set(range(num_layers))
        self._expected: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def take(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Keep layer `layer`'s planned rows of `key`/`value` `[tokens, kv_heads, head_dim]`."""
        rows = self.rows
        if self._layer_views is None:  # per-layer views of the buffer, made once
            self._layer_views = (self.kv[0].unbind(0), self.kv[1].unbind(0))
        keys, values = self._layer_views
        for src, dst in ((key, keys[layer]), (value, values[layer])):
            if src.dtype == dst.dtype:
                torch.index_select(src, 0, rows, out=dst)
            else:
                dst.copy_(src.index_select(0, rows))
        self._missing.discard(layer)

    def take_bytes(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keep layer `layer`'s planned slots of its fp8 paged cache, read
        through its uint8 views `[pages, page_size, kv_heads, head_dim]`."""
        page_size = keys.shape[1]
        pages, offsets = self.rows // page_size, self.rows % page_size
        self.kv[0, layer] = keys[pages, offsets]
        self.kv[1, layer] = values[pages, offsets]
        self._missing.discard(layer)

    def expect(self, layer: int, key_rows: torch.Tensor, value_rows: torch.Tensor) -> None:
        """For a `paged` capture whose cache views are not trusted yet: the
        K/V `[n, kv_heads, head_dim]` of its rows as attention layer `layer`
        wrote them (that layer's inputs), for `gather` to compare."""
        self._expected = (layer, key_rows, value_rows)

    def gather(self, key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], rope) -> bool:
        """Read every layer's planned rows from the paged caches (`paged`
        captures, after the forward wrote them), keys rotated by the deltas.
        False, and the capture stays incomplete, if the rows read for the
        layer given to `expect` differ from what that layer wrote: the views
        are not the cache's layout (one synchronization, when checked)."""
        gather_rerope(key_caches, value_caches, self.rows, self.deltas, rope, self.kv)
        expected, self._expected = self._expected, None
        if expected is not None:
            layer, key, value = expected
            key = key.to(self.kv.dtype)
            if self.deltas is not None:
                key = rotate_keys(key, self.deltas, rope)  # bit-identical to the gather's rotation
            if not (torch.equal(self.kv[0, layer], key) and torch.equal(self.kv[1, layer], value.to(self.kv.dtype))):
                return False
        self.deltas = None  # rotated
        self._missing.clear()
        return True

    @property
    def complete(self) -> bool:
        return not self._missing


class CaptureWriter:
    """Stores `StepCapture`s into a host pool (asynchronously on CUDA)."""

    def __init__(self, pool: HostPool, device: torch.device) -> None:
        self.pool = pool
        self.stream: torch.cuda.Stream | None = None
        self._fp8: Fp8StreamWriter | None = None
        if device.type == "cuda" and cudart.available() and cudart.is_page_locked(pool.data):
            self.stream = torch.cuda.Stream(device)
            if pool.scales is not None and pool.layer_params is None:
                self._fp8 = Fp8StreamWriter(pool, self.stream)
        # (event, what the copies before it read from and write to: kept alive until it passes)
        self._pending: list[tuple[torch.cuda.Event, object]] = []
        self._readers: list[torch.cuda.Stream] = []

    def add_reader(self, stream: "torch.cuda.Stream") -> None:
        """A stream that reads the pool on the device outside the compute
        stream's order (the GPU index's feed): every later capture waits, on
        the device, for the work queued on it by then (a capture never
        rewrites rows it is still reading), and `settle` waits for it too."""
        self._readers.append(stream)

    def write(self, capture: StepCapture, rope) -> bool:
        """Store `capture` at its host rows, keys rotated by its deltas. False
        (nothing written) if it missed a layer."""
        if not capture.complete:
            return False
        kv = capture.kv
        params = self.pool.layer_params
        if capture.deltas is not None:
            if capture.cache_bytes:
                raise ValueError("a capture of fp8 cache bytes cannot move keys: capture their K/V instead")
            rotate_layer_keys_(kv[0], capture.deltas, rope)
        if self.stream is None:
            # fp8 pools quantize whole slots where the capture is: the host writes
            for reader in self._readers:
                torch.cuda.current_stream(kv.device).wait_stream(reader)
            rows = torch.from_numpy(capture.host_rows)
            if capture.cache_bytes:
                self.pool.write_fp8_rows(rows, kv)
            else:
                self.pool.write_rows_all_layers(rows, kv if self.pool.scales is not None else kv.cpu())
            return True
        if params is not None:  # bytes as the exact pool's rows, the slots' fixed parameters set here
            if not capture.cache_bytes:
                kv = quantize_with(kv, params, token_dim=2).view(torch.uint8)
            self.pool.take_layer_params(capture.host_rows)
        self.stream.wait_stream(torch.cuda.current_stream(kv.device))
        for reader in self._readers:
            self.stream.wait_stream(reader)
        if self._fp8 is not None:
            with torch.cuda.stream(self.stream):
                tails = self._fp8.write(kv, capture.host_rows)
            done = torch.cuda.Event()
            done.record(self.stream)
            self._pending.append((done, (capture, tails)))
            return True
        data = self.pool.data  # [slots, 2, L, bt, H, D]
        bt = self.pool.block_tokens
        row_bytes = kv[0, 0, 0].numel() * kv.element_size()
        slot_bytes, n = data[0].numel() * data.element_size(), kv.shape[2]
        base = data.data_ptr()
        for begin, host_row, length in runs(capture.host_rows, period=bt):
            slot, offset = divmod(host_row, bt)
            # rows (kv, layer) of the slot are bt * row_bytes apart, as in the buffer n * row_bytes apart
            cudart.copy2d_async(base + slot * slot_bytes + offset * row_bytes, bt * row_bytes,
                                kv.data_ptr() + begin * row_bytes, n * row_bytes,
                                length * row_bytes, 2 * kv.shape[1], self.stream)
        done = torch.cuda.Event()
        done.record(self.stream)
        self._pending.append((done, (capture, kv)))  # keeps the buffers alive until the copy is done
        return True

    def take_flags(self) -> tuple[torch.Tensor, np.ndarray] | None:
        """fp8 on CUDA: `(finite [m] bool on the device, host slot of each)`
        of the blocks stored since the last call, computed on `stream` (None:
        none; every other path fails such slots in the pool at once)."""
        return self._fp8.take_flags() if self._fp8 is not None else None

    def settle(self) -> None:
        """Wait until every written capture is in the pool and the readers'
        reads queued so far are done: the host may read or rewrite it."""
        for done, _ in self._pending:
            done.synchronize()
        self._pending.clear()
        for reader in self._readers:
            reader.synchronize()

    def order(self, stream: "torch.cuda.Stream") -> None:
        """Make `stream` wait, on the device, for every capture written so far
        (its copies run in order on one stream: the last one's event covers
        them all). For readers of the pool on the device; never waits here."""
        if self._pending:
            stream.wait_event(self._pending[-1][0])

    def reap(self) -> None:
        """Let go of the captures already in the pool; never waits. Later
        copies are issued on the same stream, so they land after these."""
        self._pending = [(done, held) for done, held in self._pending if not done.query()]
