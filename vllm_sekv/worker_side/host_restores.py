"""Restores the host performs itself: every restore on CPU, and on any device
the lossy ones (SeKV `restore_codec`), whose slots are rebuilt from low-rank
factors. Every write goes through the platform's own cache-update op, but
for a pool that keeps an fp8 paged cache's bytes (`HostPool.layer_params`)
once the capture has checked its byte views of the caches: those bytes are
then written back as they are, and keys a view moves are dequantized,
rotated in float32 and rounded to the nearest e4m3 at the layer scale (the
cache-update op would round a second time its own way: vLLM's CPU kernels
truncate, which shrinks every moved key).

Runs on the worker's forward thread, before the forward. Reads the host pool;
writes vLLM's paged caches at the plan's slots, and the low-rank tiers'
factors of the slots it encodes.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllm_sekv import compat
from vllm_sekv.config import ROUTER_CODEC, SekvConfig
from vllm_sekv.index.router import FULL_RANK
from vllm_sekv.model_identity import KVGeometry
from vllm_sekv.ops import RopeSpec, rotate_keys
from vllm_sekv.store import HostPool
from vllm_sekv.store.fp8 import FP8_DTYPE, dequantize, quantize_with
from vllm_sekv.store.host_pool import to_device
from vllm_sekv.store.codecs import LowRankCodec, parse_codec
from vllm_sekv.store.lowrank_tier import LowRankTier
from vllm_sekv.workspace.step_plan import RestoreOp


def restore_ranks(config: SekvConfig, router: Any) -> list[int]:
    """The ranks lossy restores use: r for restore_codec "lowrank(r)", the
    router's expand levels for "router" (its full level is exact)."""
    codec = config.restore_codec
    if codec == "exact":
        return []
    if codec != ROUTER_CODEC:
        return [parse_codec(codec).rank]
    levels = router.rank_levels[1:]
    if any(r != FULL_RANK and r < 1 for r in levels):
        raise ValueError(f"sekv config 'router_path': rank levels {levels} must be ranks >= 1 or "
                         f"{FULL_RANK} (full)")
    return sorted({r for r in levels if r != FULL_RANK})


class HostRestores:
    """Restores of host rows into the paged caches, done by the host:
    `restore` (exact rows), `restore_lowrank` (lossy slots from their
    factors, the rest exact), `exact_rows` (what a restore writes, for SeKV
    coarse attention)."""

    def __init__(self, pool: HostPool, geometry: KVGeometry, rope: RopeSpec, block_tokens: int,
                 kv_caches: dict[str, torch.Tensor], layer_of: dict[str, int], ranks: list[int]) -> None:
        self.pool = pool
        self.geometry = geometry
        self.rope = rope
        self.block_tokens = block_tokens
        self.kv_caches = kv_caches
        self.layer_of = layer_of
        # SeKV lowrank copies of host blocks, one tier per rank a restore may ask for.
        self.lowrank = {rank: LowRankTier(LowRankCodec(rank), block_tokens, rope) for rank in ranks}

    @property
    def keeps_copies(self) -> bool:
        """Whether it keeps copies of host slots (low-rank factors) that a rewrite makes stale."""
        return bool(self.lowrank)

    def drop_rewritten(self, slots: set[int]) -> None:
        """Slots taking new bytes this step: their low-rank factors are stale."""
        for slot in slots:
            for tier in self.lowrank.values():
                tier.drop(slot)

    def restore(self, forward_context: Any, paged_slots: np.ndarray, host_rows: np.ndarray,
                rope_deltas: np.ndarray | None, cache_bytes: bool = False) -> None:
        """Write host rows into the paged caches at `paged_slots`, keys rotated
        by `rope_deltas` (None: not moved), one layer at a time. `cache_bytes`:
        the caches' fp8 byte views are trusted (`ForwardCapture.bytes_checked`);
        a pool of such bytes then writes them as they are."""
        rows = torch.from_numpy(host_rows)
        deltas = None if rope_deltas is None else torch.from_numpy(rope_deltas)
        cache_bytes = cache_bytes and self.pool.layer_params is not None
        for name, kv_cache in self.kv_caches.items():
            views = compat.paged_kv_byte_views(kv_cache, self.geometry.kv_heads, self.geometry.head_dim) \
                if cache_bytes else None
            if views is not None:
                self._write_bytes(views, self.layer_of[name], rows, torch.from_numpy(paged_slots), deltas)
                continue
            layer = compat.attention_layer(forward_context, name)
            # fp8 pools: dequantized and rotated in float32, rounded once to the model dtype
            wide = torch.float32 if self.pool.scales is not None else None
            key, value = self.pool.read_rows(self.layer_of[name], rows, wide)
            if deltas is not None:
                key = rotate_keys(key, deltas, self.rope)
            key, value = key.to(self.pool.dtype), value.to(self.pool.dtype)
            slots = torch.from_numpy(paged_slots).to(kv_cache.device)
            layer.impl.write_kv(layer, key.to(kv_cache.device), value.to(kv_cache.device), kv_cache, slots)

    def _write_bytes(self, views: tuple[torch.Tensor, torch.Tensor], layer: int, rows: torch.Tensor,
                     paged_slots: torch.Tensor, deltas: torch.Tensor | None) -> None:
        """Layer `layer`'s fp8 bytes at host `rows` into its cache's byte
        `views` at `paged_slots`; moved keys rounded again (module doc)."""
        keep = paged_slots >= 0  # -1: not written (as the cache-update op skips it)
        rows, paged_slots = rows[keep], paged_slots[keep]
        slots, offsets = rows // self.block_tokens, rows % self.block_tokens
        data = self.pool.data.view(torch.uint8)
        key, value = data[slots, 0, layer, offsets], data[slots, 1, layer, offsets]  # [n, H, D]
        if deltas is not None:
            params = self.pool.scales[slots, 0, layer]  # [n, H, 1 + D]; each row a "token" dim of one
            moved = rotate_keys(dequantize(key.view(FP8_DTYPE).unsqueeze(1), params, token_dim=1).squeeze(1),
                                deltas[keep], self.rope)
            key = quantize_with(moved.unsqueeze(1), params, token_dim=1).squeeze(1).view(torch.uint8)
        pages, at = paged_slots // views[0].shape[1], paged_slots % views[0].shape[1]
        views[0][pages, at] = key
        views[1][pages, at] = value

    def exact_rows(self, host_rows: np.ndarray, rope_deltas: np.ndarray | None,
                   device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K (rotated by `rope_deltas`, as a restore writes them) and V of host
        rows, every layer: `[L, n, H, D]` each, on the host; or read and
        rotated on `device` (`HostPool.rows_on` and its contract: the caller
        orders the device's stream after the captures)."""
        if device is None:
            keys, values = self.pool.read_rows_all_layers(torch.from_numpy(host_rows))  # [n, L, H, D]
        else:
            keys, values = self.pool.rows_on(host_rows, device)
        if rope_deltas is not None:
            n, num_layers, heads, dim = keys.shape
            keys = rotate_keys(keys.reshape(n, num_layers * heads, dim), to_device(rope_deltas, keys.device),
                               self.rope).reshape(n, num_layers, heads, dim)
        return keys.transpose(0, 1), values.transpose(0, 1)

    def restore_lowrank(self, forward_context: Any, op: RestoreOp) -> tuple[int, torch.Tensor]:
        """Restore `op` with its lossy slots rebuilt on the device from their
        low-rank factors (each slot at its rank, encoded on first use over its
        pieces and kept on the host), the rest moved exact; every layer at
        once, through the platform's cache-update op. Returns the bytes moved
        (factors + exact rows) and the keys written `[L, n, H, D]`."""
        bt = self.block_tokens
        n = len(op.host_rows)
        deltas = op.rope_deltas if op.rope_deltas is not None else np.zeros(n, dtype=np.int64)
        virtual = op.first_position + np.arange(n, dtype=np.int64) - deltas
        slots = op.host_rows // bt
        held, row_slot = np.unique(slots, return_inverse=True)  # per block, not per row
        row_rank = np.array([op.lowrank[s].rank if s in op.lowrank else 0 for s in held.tolist()],
                            dtype=np.int64)[row_slot]
        lossy = row_rank > 0
        for slot in np.unique(slots[lossy]).tolist():
            block = op.lowrank[slot]
            tier = self.lowrank[block.rank]
            if tier.pieces_of(slot) != block.pieces:
                i = int(np.argmax(slots == slot))
                tier.encode_block(self.pool, slot, int(virtual[i] - op.host_rows[i] % bt), block.pieces)
        device = next(iter(self.kv_caches.values())).device
        geo = self.geometry
        keys = torch.empty((geo.num_layers, n, geo.kv_heads, geo.head_dim), dtype=self.pool.dtype, device=device)
        values = torch.empty_like(keys)
        exact = np.nonzero(~lossy)[0]
        moved = len(exact) * (self.pool.block_bytes // bt)
        if len(exact):
            k, v = self.exact_rows(op.host_rows[exact], deltas[exact] if op.rope_deltas is not None else None)
            keys[:, exact], values[:, exact] = k.to(device, keys.dtype), v.to(device)
        for rank in np.unique(row_rank[lossy]).tolist():  # rotated straight to the view positions
            rows = row_rank == rank
            k, v, moved_rank = self.lowrank[rank].decode_rows(op.host_rows[rows], virtual[rows] + deltas[rows], device)
            where = torch.from_numpy(np.nonzero(rows)[0]).to(device)
            keys[:, where], values[:, where] = k, v
            moved += moved_rank
        paged_slots = torch.from_numpy(op.paged_slots).to(device)
        for name, kv_cache in self.kv_caches.items():
            layer = compat.attention_layer(forward_context, name)
            idx = self.layer_of[name]
            layer.impl.write_kv(layer, keys[idx], values[idx], kv_cache, paged_slots)
        return moved, keys
