"""Layer-by-layer restore, behind the forward pass.

A restore that moves every layer of a block at once must finish before layer
0's attention. This one moves layer `l` of all the step's blocks as its own
copies, so layer `l`'s attention waits only for layer `l`'s bytes while the
copy engine already moves layer `l+1`: the forward pass runs under the
transfer instead of after it.

Per layer and per run of consecutive host slots there are two pitched copies
(`cudart.copy2d_async`, K then V: rows of one slot-layer, `slot_bytes` apart in
the pool) on the copy stream, into a ring of `depth` device buffers
`[2, num_blocks, block_tokens, kv_heads, head_dim]`. `load(layer)` makes the
compute stream wait for that layer's copy event, hands the layer's K and V
`[num_blocks * block_tokens, kv_heads, head_dim]` (contiguous) to `write`, then
enqueues the copy of layer `layer + depth` into the freed buffer (the copy
stream waits for the write's event). Nothing blocks the calling thread.

Contract: `start()` once (`write` may be given after it, as the attribute,
before the first `load`), `load(l)` from the forward thread before layer `l`'s
attention reads the cache (any order; loading `l` loads every earlier layer
whose buffer it needs), `finish()` after the forward (writes any layer the
forward did not ask for, so the cache never keeps stale KV). `write` is called
exactly once per layer, on the compute stream. The pool's slots must stay
untouched until `finish()`'s copy events pass (the planner never reuses a slot
that a step restores). On CPU the same logic runs with synchronous copies
(tests); with `cudart` unavailable on CUDA, callers use `RestorePipeline`.

An fp8 pool (`workspace_codec` fp8) moves its fp8 bytes (half an exact pool's)
and, given `scales` (the pool's parameters `[slots, 2, layers, kv_heads,
1 + head_dim]`: scale and per-channel centre, `store.fp8`), the restored
blocks' parameters (float32; on CUDA copied from the pinned pool on the
copy stream before the first layer, one copy per run of slots); `write`
then gets the layer's fp8 K and V `[num_blocks, block_tokens, kv_heads,
head_dim]` and, as a fourth argument, their parameters `[num_blocks, 2,
kv_heads, 1 + head_dim]`, to dequantize, rotate and round once to the cache
dtype in one pass (`LayerWriter`, `ops.dequantize_rerope`).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from vllm_sekv.store import cudart
from vllm_sekv.store.slot_runs import runs

# (layer index, key [n * block_tokens, kv_heads, head_dim], value [same]); an fp8 pool's:
# (layer index, key [n, block_tokens, kv_heads, head_dim] float8, value [same], params [n, 2, kv_heads, 1 + head_dim])
LayerWrite = Callable[..., None]


class LayerwiseRestore:
    """One step's restore of `pool[host_slots]` (pool `[slots, 2, layers,
    block_tokens, kv_heads, head_dim]`, pinned on CUDA), layer by layer."""

    def __init__(self, pool: torch.Tensor, host_slots: np.ndarray, write: LayerWrite | None,
                 device: torch.device | str, depth: int = 4,
                 copy_stream: "torch.cuda.Stream | None" = None, scales: torch.Tensor | None = None) -> None:
        if pool.dim() != 6 or pool.shape[1] != 2:
            raise ValueError(f"pool must be [slots, 2, layers, block_tokens, kv_heads, head_dim], got {tuple(pool.shape)}")
        if not len(host_slots):
            raise ValueError("host_slots must not be empty")
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.pool = pool
        self.write = write
        self.device = torch.device(device)
        self.num_layers = pool.shape[2]
        self.num_blocks = len(host_slots)
        self.host_slots = np.asarray(host_slots)
        self.runs = runs(host_slots)  # (first block, first slot, blocks)
        self._cuda = self.device.type == "cuda"
        if self._cuda and (copy_stream is None or not cudart.is_page_locked(pool)):
            raise ValueError("on CUDA a layerwise restore needs a copy stream and a pinned pool")
        if (scales is not None) != (pool.dtype == torch.float8_e4m3fn):
            raise ValueError("scales are required with an fp8 pool, and only with one")
        self._scales = None  # fp8: [num_blocks, 2, layers, kv_heads, 1 + head_dim] float32 on the device
        self._host_scales = scales  # CUDA fp8: copied run by run on the copy stream at `start`
        if scales is not None:
            if self._cuda:
                self._scales = torch.empty((self.num_blocks, *scales.shape[1:]), dtype=torch.float32,
                                           device=self.device)
            else:
                self._scales = scales[torch.as_tensor(self.host_slots, dtype=torch.int64)]
        chunk = pool.shape[3:]
        self._bufs = [torch.empty((2, self.num_blocks, *chunk), dtype=pool.dtype, device=self.device)
                      for _ in range(min(depth, self.num_layers))]
        self._chunk_bytes = pool[0, 0, 0].numel() * pool.element_size()
        self._slot_bytes = pool[0].numel() * pool.element_size()
        self._tokens = self.num_blocks * chunk[0]
        self._stream = copy_stream
        self._copied: list = [None] * self.num_layers  # per layer: copy event (CUDA) / True
        self._freed: list = [None] * len(self._bufs)  # per buffer: event after its last write
        self._next_copy = 0
        self._next_write = 0
        self._written = [False] * self.num_layers
        self.start_event = self.copy_end_event = None

    @property
    def num_bytes(self) -> int:
        """Bytes moved host -> device (scales included)."""
        scale_bytes = 0 if self._scales is None else self._scales.numel() * 4
        return self.num_blocks * self._slot_bytes + scale_bytes

    def start(self) -> None:
        """Enqueue the copies of the first `depth` layers."""
        if self._cuda:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))  # buffers fresh from the allocator
            self.start_event = torch.cuda.Event(enable_timing=True)
            self.start_event.record(self._stream)
            if self._scales is not None:  # before the first layer's copy: every layer's event covers them
                with torch.cuda.stream(self._stream):
                    for dst, src, n in self.runs:
                        self._scales[dst:dst + n].copy_(self._host_scales[src:src + n], non_blocking=True)
        while self._next_copy < len(self._bufs):
            self._enqueue_copy()

    def load(self, layer: int) -> None:
        """Make layer `layer`'s restored KV visible to the compute stream."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")
        while not self._written[layer]:
            self._write_next(layer)

    def finish(self) -> None:
        """Write every layer not loaded yet (after the forward)."""
        for layer in range(self.num_layers):
            self.load(layer)

    # ------------------------------------------------------------ internals

    def _write_next(self, wanted: int) -> None:
        """Write the wanted layer if its copy is enqueued, else the oldest copied
        layer (its buffer is the one the wanted layer's copy waits for). While
        any layer is uncopied, some copied layer is unwritten, so the oldest
        unwritten layer always has its copy enqueued."""
        layer = wanted if self._copied[wanted] is not None else self._next_write
        buf = self._bufs[layer % len(self._bufs)]
        if self._cuda:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(self._copied[layer])
        if self.write is None:
            raise RuntimeError("a layerwise restore loaded a layer before it was given its `write`")
        if self._scales is not None:  # fp8: the blocks' bytes and their parameters for this layer
            self.write(layer, buf[0], buf[1], self._scales[:, :, layer])
        else:
            self.write(layer, buf[0].view(self._tokens, *buf.shape[3:]), buf[1].view(self._tokens, *buf.shape[3:]))
        self._written[layer] = True
        while self._next_write < self.num_layers and self._written[self._next_write]:
            self._next_write += 1
        if self._cuda:
            freed = torch.cuda.Event()
            freed.record(compute)
            self._freed[layer % len(self._bufs)] = freed
        while self._next_copy < self.num_layers and self._buffer_free(self._next_copy):
            self._enqueue_copy()

    def _buffer_free(self, layer: int) -> bool:
        """Whether the buffer that layer `layer` copies into has been written out."""
        previous = layer - len(self._bufs)
        return previous < 0 or self._written[previous]

    def _enqueue_copy(self) -> None:
        layer = self._next_copy
        index = layer % len(self._bufs)
        buf = self._bufs[index]
        if not self._cuda:
            for dst, src, n in self.runs:
                buf[:, dst:dst + n].copy_(self.pool[src:src + n, :, layer].transpose(0, 1))
            self._copied[layer] = True
        else:
            if self._freed[index] is not None:
                self._stream.wait_event(self._freed[index])
            for dst, src, n in self.runs:
                for kv in (0, 1):
                    cudart.copy2d_async(buf[kv, dst].data_ptr(), self._chunk_bytes,
                                        self.pool[src, kv, layer].data_ptr(), self._slot_bytes,
                                        self._chunk_bytes, n, self._stream)
            done = torch.cuda.Event()
            done.record(self._stream)
            self._copied[layer] = done
            if layer == self.num_layers - 1:
                self.copy_end_event = torch.cuda.Event(enable_timing=True)
                self.copy_end_event.record(self._stream)
        self._next_copy += 1

    def transfer_events(self) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        """(before the first copy, after the last) on the copy stream, CUDA
        timing events; None on CPU. Their elapsed time is the transfer's, once
        the last copy ran (`RestoreTiming` reads it then)."""
        if self.start_event is None or self.copy_end_event is None:
            return None
        return self.start_event, self.copy_end_event
