"""Views of vLLM's paged caches that a device restore writes through instead
of the platform's cache-update op, built once from the caches
(`compat.paged_kv_views`, `compat.paged_kv_byte_views`). A view's layout is
only trusted once a capture read through it matched what the attention layer
wrote (`ForwardCapture`): the caller decides when to use them.
"""
from __future__ import annotations

from typing import Any

import torch

from vllm_sekv import compat


def byte_views(kv_caches: dict[str, torch.Tensor], layer_of: dict[str, int],
               geometry: Any) -> dict[int, list[tuple[torch.Tensor, torch.Tensor]]] | None:
    """Each layer's caches' uint8 (K, V) views (`compat.paged_kv_byte_views`),
    or None if a cache has none."""
    views: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for name, kv_cache in kv_caches.items():
        pair = compat.paged_kv_byte_views(kv_cache, geometry.kv_heads, geometry.head_dim)
        if pair is None:
            return None
        views.setdefault(layer_of[name], []).append(pair)
    return views


def scatter_views(kv_caches: dict[str, torch.Tensor], layer_of: dict[str, int], geometry: Any,
                  dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """Every layer's (K, V) views `[pages, page_size, kv_heads, head_dim]`
    (`compat.paged_kv_views`), as two lists ordered by layer index, when one
    `ops.scatter_rerope` launch can write every cache: exactly one cache per
    layer index 0..num_layers-1, views in `dtype` (the pool's: the scatter
    copies, it converts nothing) on one device, all key views of one shape
    and stride set and all value views of another (the kernel's per-layer
    pointer table). Else None."""
    caches: dict[int, list[torch.Tensor]] = {}
    for name, kv_cache in kv_caches.items():
        caches.setdefault(layer_of[name], []).append(kv_cache)
    if sorted(caches) != list(range(geometry.num_layers)) or any(len(c) != 1 for c in caches.values()):
        return None
    views = [compat.paged_kv_views(caches[i][0], geometry.kv_heads, geometry.head_dim)
             for i in range(geometry.num_layers)]
    if any(v is None for v in views):
        return None
    keys, values = [k for k, _ in views], [v for _, v in views]
    for group in (keys, values):
        first = group[0]
        if any(t.dtype != dtype or t.device != first.device or t.shape != first.shape or t.stride() != first.stride()
               for t in group):
            return None
    return keys, values
