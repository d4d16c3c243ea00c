"""Restored K/V into vLLM's paged caches, layer by layer or a batch of whole
slots at a time, through the platform's own cache-update op (`write_kv` of
the sekv attention backend), keys re-RoPE'd first when the restore moves
them. An fp8 pool's blocks are dequantized, rotated and rounded to the model
dtype in one pass on the way (`ops.dequantize_rerope`)."""
from __future__ import annotations

from typing import Any

import torch

from vllm_sekv.ops import dequantize_rerope, rotate_keys, rotate_layer_keys_


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

    def route(self, mapping: torch.Tensor, deltas: torch.Tensor | None) -> None:
        """Where a layerwise restore's tokens go (paged slot, -1: skipped) and
        their RoPE deltas (None: keys not moved)."""
        self.mapping, self.deltas = mapping, deltas

    def __call__(self, idx: int, key: torch.Tensor, value: torch.Tensor, params: torch.Tensor | None = None) -> None:
        """One layer of a layerwise restore: K and V `[tokens, kv_heads, head_dim]`, or an fp8 pool's
        `[blocks, block_tokens, kv_heads, head_dim]` with their `params [blocks, 2, kv_heads, 1 + head_dim]`."""
        if self.mapping is None:
            raise RuntimeError("a layerwise restore wrote a layer before its writer was routed")
        if params is None:
            self._write(idx, key, value, self.mapping, self.deltas)
            return
        keys, values = dequantize_rerope(key.unsqueeze(1), value.unsqueeze(1), params.unsqueeze(2),
                                         self.deltas if self.rerope else None, self.rope, self.geometry.dtype)
        self._store(idx, keys[0], values[0], self.mapping)

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
