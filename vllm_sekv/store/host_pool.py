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

Codec (`workspace_codec`, `store.fp8`): "exact" stores K/V in the model dtype
(`dtype`), bit for bit. "fp8" stores `data` as float8 e4m3 (same 6-d shape)
plus `scales [num_slots, 2, num_layers, kv_heads, 1 + head_dim]` float32
(pinned with the pool): each (slot, K or V, layer, KV head)'s scale and
per-channel centre (`store.fp8`), so a slot takes 0.56 of the bytes at 32
tokens a block and head_dim 128 (`bytes_per_block` counts both tensors).
Writers hand full-precision rows; readers (`read_rows*`, `slot_keys_on`, `block_keys`,
`dequantized_slots`) get them back in `dtype`. Whoever moves raw slot bytes
(`data`; restores, NVMe records) must move `scales` of the same slots too.

fp8 writes of part of a slot (capture steps, a few rows at a time): a
block's scale must cover every row it holds, so its rows wait in a *tail*, a
copy of the slot in the model dtype kept beside the pool, until every row of
a layer is written; that layer is then quantized once, with one scale over
all its rows (one rounding per element, as for a whole slot). A write that
includes a block's first row (offset 0) starts its tail afresh in the layers
it writes (a block's tokens come in order, as captures write them); rows of
a slot no tail holds are not written into it: a write that finds no tail and
does not start one means the block's earlier rows are gone (its tail was
dropped), and the slot is failed. At most `TAIL_BLOCKS` tails are kept; past
that the least recently written one is dropped (the partial block of a
request that ended is never completed). Readers of rows (`read_rows*`) see
an incomplete layer's rows as written (zero where not written yet); readers
of whole slots read the quantized bytes, which only complete blocks have
(restores read committed blocks only).
A slot given non-finite K/V is failed: its scales become NaN (any read of it
is NaN, never plausible KV) and it is reported by `take_failed_slots()`; the
capture then fails it (a miss, recomputed). A slot filled whole by an NVMe
read is complete.

fp8 over an fp8 paged cache (`layer_params`, `store.fp8.cache_params`): the
slots hold the bytes the cache holds, with every layer's fixed scale and zero
centres as their parameters. Rows are written straight into their slots (one
rounding each, no tails): `write_fp8_rows` stores bytes as they are, the
other writers round model-dtype rows to the fixed scales (`quantize_with`).
Readers are those of any fp8 pool.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch

from vllm_sekv.store import cudart
from vllm_sekv.store.fp8 import CODECS, FP8_DTYPE, dequantize, quantize_blocks, quantize_with
from vllm_sekv.store.slot_runs import SlotRuns, runs, whole_slots

PAGE_BYTES = 4096
# fp8: at most this many incomplete blocks wait in the model dtype (a tail
# each, one block's K/V of every layer): about one per running request.
TAIL_BLOCKS = 256
# fp8: the scratch one quantizing call may take where the K/V are (bounds
# the slots quantized at once).
QUANTIZE_SCRATCH_BYTES = 256 << 20


@dataclass
class _Tail:
    """An incomplete fp8 block: its rows so far in the model dtype, `kv [2,
    num_layers, block_tokens, kv_heads, head_dim]`, and which rows of which
    layer are written, `written [num_layers, block_tokens]`."""

    kv: torch.Tensor
    written: np.ndarray


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
        codec: str = "exact",
        layer_params: torch.Tensor | None = None,
    ) -> None:
        """`layer_params [2, num_layers, kv_heads, 1 + head_dim]` (codec fp8
        only): the fixed parameters of an fp8 paged cache's bytes (module doc)."""
        if codec not in CODECS:
            raise ValueError(f"codec must be one of {CODECS}, got {codec!r}")
        if layer_params is not None and codec != "fp8":
            raise ValueError("layer_params are the parameters of an fp8 pool")
        self.layer_params = layer_params
        self.block_tokens = block_tokens
        self.codec = codec
        self.dtype = dtype  # what writers give and readers get back
        self.failed: set[int] = set()  # fp8: slots given non-finite K/V, or whose rows were lost
        self._tails: dict[int, _Tail] = {}  # fp8: incomplete blocks by slot, least recently written first
        storage = FP8_DTYPE if codec == "fp8" else dtype
        shape = (num_slots, 2, num_layers, block_tokens, kv_heads, head_dim)
        self.data = self._alloc(shape, storage, pin_memory)
        self.scales: torch.Tensor | None = None
        if codec == "fp8":
            self.scales = self._alloc((num_slots, 2, num_layers, kv_heads, 1 + head_dim), torch.float32,
                                      pin_memory)
            self.scales.zero_()
            self.scales[..., 0] = 1.0  # scale 1, centre 0
            if layer_params is not None:
                self.scales[:] = layer_params
        self.pinned = bool(pin_memory and self.data.numel())  # page-locked: the copy engine reads it directly

    def _alloc(self, shape: tuple[int, ...], dtype: torch.dtype, pin_memory: bool) -> torch.Tensor:
        # Page-aligned, so that slots can be the target of O_DIRECT reads.
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = itemsize * int(np.prod(shape))
        raw = torch.empty(nbytes + PAGE_BYTES, dtype=torch.uint8)
        offset = -raw.data_ptr() % PAGE_BYTES
        out = raw[offset : offset + nbytes].view(dtype).view(shape)
        if pin_memory and nbytes:
            # Pinned at exactly its size (torch's pinned allocator would round
            # it up to a power of two). Touching every page first spreads the
            # page faults over torch's threads; registering then only locks.
            raw.zero_()
            cudart.register_host(out.data_ptr(), nbytes)
            weakref.finalize(self, _unpin, out.data_ptr())
        return out

    @property
    def num_slots(self) -> int:
        return self.data.shape[0]

    @property
    def block_bytes(self) -> int:
        """Host bytes of one slot: its K/V, and its scales under fp8."""
        n = self.data[0].numel() * self.data.element_size()
        if self.scales is not None:
            n += self.scales[0].numel() * self.scales.element_size()
        return n

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
        codec: str = "exact",
    ) -> int:
        if codec == "fp8":
            return 2 * num_layers * kv_heads * (block_tokens * head_dim + 4 * (1 + head_dim))
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_tokens * kv_heads * head_dim * itemsize

    def in_tails(self, host_rows: np.ndarray) -> np.ndarray:
        """`[n]` bool: which rows belong to a block still incomplete in some
        layer (fp8: its rows wait in a model-dtype tail and the slot's fp8
        bytes and scales are not written yet). Only `read_rows` and
        `read_rows_all_layers` see such rows; a raw copy of the slot reads
        garbage. All False for an exact pool."""
        if not self._tails:
            return np.zeros(len(host_rows), dtype=bool)
        return np.isin(np.asarray(host_rows) // self.block_tokens, np.fromiter(self._tails, dtype=np.int64))

    def take_failed_slots(self) -> set[int]:
        """fp8: slots written with non-finite K/V since the last call (they
        must not be committed)."""
        failed, self.failed = self.failed, set()
        return failed

    def write_rows(
        self, layer: int, rows: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        runs: SlotRuns | None = None,
    ) -> None:
        """Store K/V `[n, kv_heads, head_dim]` of one layer at flat token rows
        `rows[n]` (row = slot * block_tokens + offset). `runs` (`slot_runs(rows)`,
        computed once for all layers) lets whole slots in a row be written as
        slices (one memcpy each) instead of row by row."""
        runs = runs if runs is not None else self.slot_runs(rows)
        if self.layer_params is not None:
            kv = quantize_with(torch.stack([key, value]), self.layer_params[:, layer], token_dim=1)
            self._write_raw(rows, kv.unsqueeze(1), runs, slice(layer, layer + 1))
            return
        if self.scales is not None:
            self._write_fp8(rows, torch.stack([key, value], dim=1).unsqueeze(2), runs, layer)
            return
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

    def write_rows_all_layers(self, rows: torch.Tensor, kv: torch.Tensor, runs: SlotRuns | None = None) -> None:
        """Store K/V of every layer, `kv [2, num_layers, n, kv_heads, head_dim]`
        (K then V, the order of a slot's own layout), at flat token rows
        `rows[n]`: `write_rows` for all layers in one copy per run of whole
        slots and one for the other rows. `kv` is a host tensor, or under fp8
        may be on a device: whole slots are quantized there (only their fp8
        bytes and scales come to the host, synchronously), the other rows are
        copied over into their blocks' tails."""
        runs = runs if runs is not None else self.slot_runs(rows)
        if self.layer_params is not None:
            self.write_fp8_rows(rows, quantize_with(kv, self.layer_params, token_dim=2), runs)
        elif self.scales is not None:
            self._write_fp8(rows, kv.permute(2, 0, 1, 3, 4), runs, None)
        else:
            self._write_raw(rows, kv, runs, slice(None))

    def write_fp8_rows(self, rows: torch.Tensor, kv: torch.Tensor, runs: SlotRuns | None = None) -> None:
        """A pool over an fp8 paged cache (`layer_params`): store `kv [2,
        num_layers, n, kv_heads, head_dim]`, the cache's own bytes (float8
        e4m3 or their uint8 view, on the host or a device), as they are at
        flat token rows `rows[n]`; their slots take the fixed parameters."""
        if self.layer_params is None:
            raise ValueError("only a pool over an fp8 paged cache stores fp8 bytes as they are")
        runs = runs if runs is not None else self.slot_runs(rows)
        self._write_raw(rows, kv.view(FP8_DTYPE), runs, slice(None))

    def _write_raw(self, rows: torch.Tensor, kv: torch.Tensor, runs: SlotRuns, layers: slice) -> None:
        """`kv [2, L', n, kv_heads, head_dim]` in the slots' own dtype into
        `layers` of the slots at `rows`: a copy per run of whole slots, one
        for the other rows. A pool with `layer_params` sets its slots'
        parameters too."""
        bt = self.block_tokens
        raw = self.data if self.data.dtype != FP8_DTYPE else self.data.view(torch.uint8)  # indexed writes
        kv = kv.to(self.data.dtype).cpu()
        kv = kv.view(torch.uint8) if kv.dtype == FP8_DTYPE else kv
        for begin, first_slot, count in runs.whole:
            part = kv[:, :, begin : begin + count * bt]  # [2, L', count * bt, H, D]
            part = part.reshape(*part.shape[:2], count, bt, *part.shape[3:])
            raw[first_slot : first_slot + count, :, layers] = part.permute(2, 0, 1, 3, 4, 5)
        rest = runs.rest
        if len(rest):
            slots, offsets = rows[rest] // bt, rows[rest] % bt
            # advanced indices around slices: the indexed view is [n, 2, L', H, D]
            raw[:, :, layers][slots, :, :, offsets] = kv[:, :, rest].permute(2, 0, 1, 3, 4)
        if self.layer_params is not None:
            self.take_layer_params(rows)

    def take_layer_params(self, rows: torch.Tensor | np.ndarray) -> None:
        """A pool over an fp8 paged cache: the slots of flat `rows` take the
        fixed parameters (`layer_params`)."""
        self.scales[torch.unique(torch.as_tensor(rows).cpu() // self.block_tokens)] = self.layer_params

    def _write_fp8(self, rows: torch.Tensor, kv: torch.Tensor, runs: SlotRuns, layer: int | None) -> None:
        """fp8: store `kv [n, 2, L', kv_heads, head_dim]` (L' = every layer,
        or 1 for `layer`) at `rows`: whole slots quantized as they are, the
        other rows into their slots' tails, each layer quantized once its
        tail holds all its rows (see the module doc)."""
        bt = self.block_tokens
        layers = slice(None) if layer is None else slice(layer, layer + 1)
        rows = torch.as_tensor(rows, dtype=torch.int64).cpu()
        for begin, first_slot, count in runs.whole:
            part = kv[begin : begin + count * bt]  # [count * bt, 2, L', H, D]
            part = part.reshape(count, bt, *part.shape[1:]).permute(0, 2, 3, 1, 4, 5)  # [count, 2, L', bt, H, D]
            self._store_slots(torch.arange(first_slot, first_slot + count), layers, part)
            for j, slot in enumerate(range(first_slot, first_slot + count)):
                if slot in self._tails:
                    self._settle_tail(slot, layers, part[j])
        rest = runs.rest
        if not len(rest):
            return
        slot_of, offsets = (rows[rest] // bt).numpy(), (rows[rest] % bt).numpy()
        values = kv[rest.to(kv.device)].to(device="cpu", dtype=self.dtype)  # [m, 2, L', H, D]
        for slot in np.unique(slot_of).tolist():
            mine = np.nonzero(slot_of == slot)[0]
            tail = self._tail_for(slot, layers, starts=bool((offsets[mine] == 0).any()))
            if tail is None:
                continue
            at = torch.from_numpy(offsets[mine])
            tail.kv[:, layers, at] = values[torch.from_numpy(mine)].permute(1, 2, 0, 3, 4)
            tail.written[layers, offsets[mine]] = True
            done = [l for l in range(self.data.shape[2])[layers] if tail.written[l].all()]
            if len(done) == tail.written.shape[0]:  # every layer at once
                self._store_slots(torch.tensor([slot]), slice(None), tail.kv[None])
            else:
                for l in done:
                    self._store_slots(torch.tensor([slot]), slice(l, l + 1), tail.kv[None, :, l : l + 1])
            if tail.written.all():
                del self._tails[slot]

    def _tail_for(self, slot: int, layers: slice, starts: bool, pinned: bool = False) -> _Tail | None:
        """The tail of `slot` for a partial write into `layers`, made the most
        recently written; a write that `starts` the block empties those
        layers of it first. None when there is no tail and the write does not
        start one: the block's earlier rows are gone, and the slot is failed.
        `pinned` (writers that copy into tails on a device stream, which
        start every layer at once): a new tail's buffer is page-locked, and a
        tail that `starts` again gets a new buffer instead of being emptied in
        place (a copy into the old one may still be on its way)."""
        tail = self._tails.pop(slot, None)
        if tail is not None and starts and pinned:
            tail = None
        if tail is None:
            if not starts:
                self.failed.add(slot)
                return None
            while len(self._tails) >= TAIL_BLOCKS:
                self._tails.pop(next(iter(self._tails)))
            shape = (2, *self.data.shape[2:])
            tail = _Tail(torch.zeros(shape, dtype=self.dtype, pin_memory=pinned), np.zeros(shape[1:3], dtype=bool))
        elif starts:
            tail.kv[:, layers] = 0
            tail.written[layers] = False
        self._tails[slot] = tail
        return tail

    def open_tail(self, slot: int, starts: bool) -> _Tail | None:
        """For a writer that copies rows of every layer into tails on a
        device stream (`store.fp8_capture`): `slot`'s tail in page-locked
        memory (see `_tail_for`). The writer marks the rows it copies in
        `written` and calls `close_tail` once every row is; host readers must
        wait for its copies first."""
        return self._tail_for(slot, slice(None), starts, pinned=True)

    def close_tail(self, slot: int) -> None:
        """Forget `slot`'s tail: its block is complete, or written whole."""
        self._tails.pop(slot, None)

    def _settle_tail(self, slot: int, layers: slice, block: torch.Tensor) -> None:
        """`slot` was written whole in `layers` (`block [2, L', bt, H, D]`):
        its tail holds those rows too, or goes once it holds every row."""
        tail = self._tails[slot]
        tail.written[layers] = True
        if tail.written.all():
            del self._tails[slot]
        else:
            tail.kv[:, layers] = block.to(device="cpu", dtype=self.dtype)

    def _store_slots(self, slots: torch.Tensor, layers: slice, block: torch.Tensor) -> None:
        """Quantize `block [m, 2, L', bt, H, D]` (full precision, on any
        device: quantized there, so only fp8 bytes and scales come to the
        host) into `slots` at `layers`; slots with non-finite values are failed.
        A few slots at a time: quantizing takes about 20 bytes of scratch per
        element, and a prefill's capture may hand over gigabytes of K/V on a
        device whose memory vLLM has already given to its cache."""
        for at, q, scale, finite in quantize_blocks(block, QUANTIZE_SCRATCH_BYTES):
            part = slots[at : at + len(q)]
            q, scale, bad = q.cpu(), scale.cpu(), ~finite.cpu()
            if bool(bad.any()):
                self.failed.update(part[bad].tolist())
            self.data[part, :, layers] = q
            self.scales[part, :, layers] = scale

    def _overlay_tails(self, slots: torch.Tensor, offsets: torch.Tensor, layers: slice,
                       k: torch.Tensor, v: torch.Tensor) -> None:
        """Rows of an incomplete block read from its tail: `k`, `v [n, L',
        H, D]` (or `[n, H, D]` for one layer) at `slots` / `offsets`, in each
        layer the tail has not completed, take the tail's row (as written, or
        zero: not written yet)."""
        slots = np.asarray(slots)
        for i in np.nonzero(np.isin(slots, list(self._tails)))[0].tolist():
            tail, off = self._tails[int(slots[i])], int(offsets[i])
            for l in range(self.data.shape[2])[layers]:
                if not tail.written[l].all():
                    at = (i, l) if k.dim() == 4 else (i,)
                    k[at] = tail.kv[0, l, off].to(k.dtype)
                    v[at] = tail.kv[1, l, off].to(v.dtype)

    def slot_runs(self, rows: torch.Tensor) -> SlotRuns:
        """`rows` split into runs of whole consecutive slots and the rest (`slot_runs.whole_slots`)."""
        return whole_slots(rows, self.block_tokens)

    def read_rows(self, layer: int, rows: torch.Tensor,
                  dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V `[n, kv_heads, head_dim]` of one layer at flat token rows (in
        `dtype`, default the pool's `dtype`; fp8 pools dequantize to it)."""
        slots, offsets = rows // self.block_tokens, rows % self.block_tokens
        k, v = self.data[slots, 0, layer, offsets], self.data[slots, 1, layer, offsets]
        if self.scales is None:
            return (k, v) if dtype is None else (k.to(dtype), v.to(dtype))
        s = self.scales[slots, :, layer]  # [n, 2, H, 1 + D]: each row its slot's parameters
        out = dtype or self.dtype
        # [n, H, D] with [n, H, 1 + D] parameters: a "token" dim of size one per row
        k = dequantize(k.unsqueeze(1), s[:, 0], token_dim=1, dtype=out).squeeze(1)
        v = dequantize(v.unsqueeze(1), s[:, 1], token_dim=1, dtype=out).squeeze(1)
        if self._tails:
            self._overlay_tails(slots, offsets, slice(layer, layer + 1), k, v)
        return k, v

    def read_rows_all_layers(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V `[n, num_layers, kv_heads, head_dim]` of every layer at flat token rows (in `dtype`)."""
        slots, offsets = rows // self.block_tokens, rows % self.block_tokens
        k, v = self.data[slots, 0, :, offsets], self.data[slots, 1, :, offsets]
        if self.scales is None:
            return k, v
        s = self.scales[slots]  # [n, 2, L, H, 1 + D]
        # [n, L, H, D] with [n, L, H, 1 + D] parameters: a "token" dim of size one per row
        k = dequantize(k.unsqueeze(2), s[:, 0], token_dim=2, dtype=self.dtype).squeeze(2)
        v = dequantize(v.unsqueeze(2), s[:, 1], token_dim=2, dtype=self.dtype).squeeze(2)
        if self._tails:
            self._overlay_tails(slots, offsets, slice(None), k, v)
        return k, v

    def dequantized_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Whole slots `[n, 2, num_layers, block_tokens, kv_heads, head_dim]` in `dtype` (a copy)."""
        slots = torch.as_tensor(slots, dtype=torch.int64)
        if self.scales is None:
            return self.data[slots]
        return dequantize(self.data[slots], self.scales[slots], token_dim=3, dtype=self.dtype)

    def slot_keys_on(self, slots: list[int], device: torch.device) -> torch.Tensor:
        """Keys of whole slots, `[n, num_layers, block_tokens, kv_heads,
        head_dim]` in `dtype`, on `device`. From the pinned pool to CUDA: pitched copies
        on the current stream, one per run of consecutive slots, and the host
        never waits (the caller orders that stream after any capture still
        being copied into these slots, `CaptureWriter.order`); fp8 keys move
        as fp8 with their scales and are dequantized there. Elsewhere a
        host gather (dequantized on the host), then a copy."""
        return self._slots_on(slots, device, keys_only=True)

    def slots_on(self, slots: list[int], device: torch.device) -> torch.Tensor:
        """K and V of whole slots, `[n, 2, num_layers, block_tokens, kv_heads,
        head_dim]` in `dtype`, on `device`, moved as `slot_keys_on` moves keys
        (the same contract: the caller orders the current stream after the
        captures)."""
        return self._slots_on(slots, device, keys_only=False)

    def _slots_on(self, slots: list[int], device: torch.device, keys_only: bool) -> torch.Tensor:
        index = torch.tensor(slots, dtype=torch.int64)
        pick = (index, 0) if keys_only else (index,)
        token_dim = 2 if keys_only else 3
        if device.type != "cuda" or not self.pinned:
            if self.scales is None:
                return self.data[pick].to(device)
            return dequantize(self.data[pick], self.scales[pick], token_dim=token_dim, dtype=self.dtype).to(device)
        part = self.data[0, 0] if keys_only else self.data[0]
        out = torch.empty((len(slots), *part.shape), dtype=self.data.dtype, device=device)
        width = part.numel() * part.element_size()
        slot_bytes = self.data[0].numel() * self.data.element_size()
        stream = torch.cuda.current_stream(device)
        for at, first, n in runs(slots):
            src = self.data[first, 0] if keys_only else self.data[first]
            cudart.copy2d_async(out[at].data_ptr(), width, src.data_ptr(), slot_bytes, width, n, stream)
        if self.scales is None:
            return out
        return dequantize(out, to_device(self.scales[pick], device), token_dim=token_dim, dtype=self.dtype)

    def rows_on(self, rows: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """`read_rows_all_layers` with the result on `device`: K/V `[n,
        num_layers, kv_heads, head_dim]` at flat token rows. To CUDA the rows'
        whole slots move (`slots_on`, its contract) and the rows are picked
        there: no gather and no rotation on the host; fp8 rows of blocks still
        in their tails are read on the host. Elsewhere `read_rows_all_layers`."""
        rows = np.asarray(rows, dtype=np.int64)
        if device.type != "cuda" or not self.pinned:
            k, v = self.read_rows_all_layers(torch.from_numpy(rows))
            return k.to(device), v.to(device)
        slots, at = np.unique(rows // self.block_tokens, return_inverse=True)
        blocks = self.slots_on(slots.tolist(), device)  # [u, 2, L, bt, H, D]
        at, offsets = to_device(at.astype(np.int64), device), to_device(rows % self.block_tokens, device)
        k, v = blocks[at, 0, :, offsets], blocks[at, 1, :, offsets]  # [n, L, H, D]
        tails = np.flatnonzero(self.in_tails(rows))
        if len(tails):
            hk, hv = self.read_rows_all_layers(torch.from_numpy(rows[tails]))
            picked = to_device(tails, device)
            k[picked], v[picked] = hk.to(device), hv.to(device)
        return k, v

    def block_keys(self, slot: int) -> torch.Tensor:
        """All keys of one slot, `[num_layers, block_tokens, kv_heads, head_dim]`
        (a view; under fp8 a dequantized copy)."""
        if self.scales is None:
            return self.data[slot, 0]
        return dequantize(self.data[slot, 0], self.scales[slot, 0], token_dim=1, dtype=self.dtype)


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
