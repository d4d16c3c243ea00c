"""Restored K/V into vLLM's paged caches, layer by layer or a batch of whole
slots at a time, through the platform's own cache-update op (`write_kv` of
the sekv attention backend), keys re-RoPE'd first when the restore moves
them. An fp8 pool's blocks are dequantized, rotated and rounded to the model
dtype in one pass on the way (`ops.dequantize_rerope`). A layerwise restore
of an fp8 paged cache's own bytes (`HostPool.layer_params`), routed with the
caches' checked byte views, writes those bytes into the pages as they are
instead, keys it moves dequantized, rotated in float32 and rounded to the
nearest e4m3 at their scale."""
from __future__ import annotations

from typing import Any

import torch

from vllm_sekv.ops import dequantize_rerope, rotate_keys, rotate_layer_keys_
from vllm_sekv.store.fp8 import FP8_DTYPE, dequantize, quantize_with

# (layer index -> its caches' uint8 (K, V) views; the restore's tokens to write `[m]`, their pages `[m]`
# and offsets in them `[m]`), all on the device
ByteRoute = tuple[dict[int, list[tuple[torch.Tensor, torch.Tensor]]], torch.Tensor, torch.Tensor, torch.Tensor]


class LayerWriter:
    """Writes restored K/V of one layer (or a batch of whole slots, every
    layer) into the paged caches with the platform's cache-update op, keys
    re-RoPE'd by the tokens' deltas first when the restore moves them. A
    layerwise restore's writer gets its destinations (`route`) after the
    first copies are enqueued, before the forward asks for a layer.

    `layers`: layer index -> [(vLLM attention layer, its paged cache)]."""

    def __init__(self, layers: dict[int, list], geometry: Any, rope: Any, rerope: bool) -> None:
        self.layers = layers
        self.geometry = geometry
        self.rope = rope
        self.rerope = rerope
        self.mapping: torch.Tensor | None = None
        self.deltas: torch.Tensor | None = None
        self.bytes: ByteRoute | None = None

    def _write(self, idx: int, key: torch.Tensor, value: torch.Tensor,
               mapping: torch.Tensor, deltas: torch.Tensor | None) -> None:
        if self.rerope:
            key = rotate_keys(key, deltas, self.rope)
        self._store(idx, key, value, mapping)

    def _store(self, idx: int, key: torch.Tensor, value: torch.Tensor, mapping: torch.Tensor) -> None:
        """Layer `idx`'s K (rotated already) and V into its caches, in the model dtype (K/V read back in
        float32 from an fp8 block's tail are rounded once here)."""
        key, value = key.to(self.geometry.dtype), value.to(self.geometry.dtype)
        for layer, kv_cache in self.layers.get(idx, ()):
            layer.impl.write_kv(layer, key, value, kv_cache, mapping)

    def route(self, mapping: torch.Tensor, deltas: torch.Tensor | None, cache_bytes: ByteRoute | None = None) -> None:
        """Where a layerwise restore's tokens go (paged slot, -1: skipped) and
        their RoPE deltas (None: keys not moved); `cache_bytes`: the same
        destinations through the caches' byte views, for an fp8 paged
        cache's own bytes."""
        self.mapping, self.deltas, self.bytes = mapping, deltas, cache_bytes

    def __call__(self, idx: int, key: torch.Tensor, value: torch.Tensor, params: torch.Tensor | None = None) -> None:
        """One layer of a layerwise restore: K and V `[tokens, kv_heads, head_dim]`, or an fp8 pool's
        `[blocks, block_tokens, kv_heads, head_dim]` with their `params [blocks, 2, kv_heads, 1 + head_dim]`."""
        if self.mapping is None:
            raise RuntimeError("a layerwise restore wrote a layer before its writer was routed")
        if params is None:
            self._write(idx, key, value, self.mapping, self.deltas)
            return
        if self.bytes is not None:
            self._store_bytes(idx, key, value, params)
            return
        keys, values = dequantize_rerope(key.unsqueeze(1), value.unsqueeze(1), params.unsqueeze(2),
                                         self.deltas if self.rerope else None, self.rope, self.geometry.dtype)
        self._store(idx, keys[0], values[0], self.mapping)

    def _store_bytes(self, idx: int, key: torch.Tensor, value: torch.Tensor, params: torch.Tensor) -> None:
        """Layer `idx`'s fp8 bytes `[blocks, block_tokens, kv_heads, head_dim]`
        into its caches' byte views as they are; moved keys rounded again
        (parameters `[blocks, 2, kv_heads, 1 + head_dim]`)."""
        views, tokens, pages, offsets = self.bytes
        block_tokens = key.shape[1]
        key = key.reshape(-1, *key.shape[2:]).view(torch.uint8).index_select(0, tokens)
        value = value.reshape(-1, *value.shape[2:]).view(torch.uint8).index_select(0, tokens)
        if self.rerope:
            at = params[tokens // block_tokens, 0]  # [m, kv_heads, 1 + head_dim]: each token a "token" dim of one
            moved = rotate_keys(dequantize(key.view(FP8_DTYPE).unsqueeze(1), at, token_dim=1).squeeze(1),
                                self.deltas.index_select(0, tokens), self.rope)
            key = quantize_with(moved.unsqueeze(1), at, token_dim=1).squeeze(1).view(torch.uint8)
        for keys, values in views.get(idx, ()):
            keys[pages, offsets] = key
            values[pages, offsets] = value

    def batch(self, staged: torch.Tensor, mapping: torch.Tensor, deltas: torch.Tensor,
              scales: torch.Tensor | None = None) -> None:
        """A batch of whole slots `[m, 2, layers, block_tokens, kv_heads, head_dim]`
        (fp8 with its parameters `scales [m, 2, layers, kv_heads, 1 + head_dim]`:
        dequantized, rotated and rounded in one pass, `ops.dequantize_rerope`)."""
        geo = self.geometry
        if scales is not None:
            keys, values = dequantize_rerope(staged[:, 0], staged[:, 1], scales, deltas if self.rerope else None,
                                             self.rope, geo.dtype)
            for idx in self.layers:
                self._store(idx, keys[idx], values[idx], mapping)
            return
        # K and V as [layers, tokens, kv_heads, head_dim] (one copy each), every layer's keys rotated in one
        # call: per layer only the cache-update op is left (a restore of resident blocks waits on launches).
        keys, values = (staged[:, i].transpose(0, 1).reshape(geo.num_layers, -1, geo.kv_heads, geo.head_dim)
                        for i in (0, 1))
        if self.rerope:
            rotate_layer_keys_(keys, deltas, self.rope)
        keys, values = keys.to(geo.dtype), values.to(geo.dtype)
        for idx in self.layers:
            self._store(idx, keys[idx], values[idx], mapping)
