"""PyTorch references for moving K/V between packed rows and paged caches:
scatter + re-RoPE (same signature as `scatter.scatter_rerope`), and its mirror,
`gather_rerope` (paged caches -> a capture buffer; `gather.gather_rerope`).

Source: a packed staging buffer in the host pool's layout
`[n_rows, 2, num_layers, block_tokens, kv_heads, head_dim]` (index 0 = K post-RoPE,
1 = V). Block j of the batch is staging row `src_rows[j]` (default: row j); its
token i is batch token `j * block_tokens + i`.

Destination: per layer l a key view `key_caches[l]` and a value view
`value_caches[l]`, each `[num_pages, page_size, kv_heads, head_dim]` with any
strides (vLLM's FlashAttention cache `kv[l]` of shape [2, pages, page, H, D] gives
`kv[l][0]`, `kv[l][1]`; a head-major cache gives `.transpose(1, 2)` views).
Batch token n goes to slot `slot_mapping[n]` = page * page_size + offset;
slot -1 skips the token. K is rotated by `delta_positions[n]` (new position minus
stored position) with `rotate_keys` (`delta_positions` None: K is copied as it
is, like V); V is copied.

Optional `scales [n_rows, 2, num_layers, kv_heads, 1 + head_dim]` float32
(per staging row, K or V, layer and head: a scale and a centre per channel;
`store.fp8`): the staging buffer then holds float8 e4m3 (an fp8 host pool's
bytes) and each element is dequantized as `float(x) * scale + centre`, keys
rotated in float32, and the result rounded once to the caches' dtype.

Mutates only the destination caches (in place); the staging buffer is read only.
Raises ValueError on mismatched shapes or dtypes.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .rope_spec import RopeSpec
from .rotate_reference import rotate_keys


def check_scatter_args(staging, key_caches, value_caches, slot_mapping, delta_positions, src_rows,
                       scales=None) -> int:
    """Validate arguments; return the number of batch blocks. Raises ValueError."""
    if staging.dim() != 6 or staging.shape[1] != 2:
        raise ValueError(f"staging must be [n, 2, layers, block_tokens, kv_heads, head_dim], got {tuple(staging.shape)}")
    _, _, num_layers, block_tokens, kv_heads, head_dim = staging.shape
    if scales is not None:
        if staging.dtype != torch.float8_e4m3fn:
            raise ValueError(f"scales go with float8_e4m3fn staging, got {staging.dtype}")
        want = (staging.shape[0], 2, num_layers, kv_heads, 1 + head_dim)
        if tuple(scales.shape) != want or scales.dtype != torch.float32:
            raise ValueError(f"scales must be float32 {list(want)}, got {scales.dtype} {list(scales.shape)}")
    if len(key_caches) != num_layers or len(value_caches) != num_layers:
        raise ValueError(f"need {num_layers} key and value caches, got {len(key_caches)} and {len(value_caches)}")
    for cache in list(key_caches) + list(value_caches):
        if cache.dim() != 4 or tuple(cache.shape[2:]) != (kv_heads, head_dim):
            raise ValueError(f"cache views must be [pages, page_size, {kv_heads}, {head_dim}], got {tuple(cache.shape)}")
        if (scales is None and cache.dtype != staging.dtype) or cache.device != key_caches[0].device:
            raise ValueError(f"cache {cache.dtype}/{cache.device} vs staging {staging.dtype}/{key_caches[0].device}")
    num_batch_blocks = staging.shape[0] if src_rows is None else int(src_rows.shape[0])
    num_tokens = num_batch_blocks * block_tokens
    if slot_mapping.shape != (num_tokens,) or (delta_positions is not None
                                               and delta_positions.shape != (num_tokens,)):
        raise ValueError(
            f"slot_mapping / delta_positions must be [{num_tokens}], got "
            f"{tuple(slot_mapping.shape)} / {None if delta_positions is None else tuple(delta_positions.shape)}"
        )
    return num_batch_blocks


def scatter_rerope(
    staging: torch.Tensor,
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    slot_mapping: torch.Tensor,
    delta_positions: torch.Tensor | None,
    rope: RopeSpec,
    src_rows: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
) -> None:
    """Write K (rotated by `delta_positions`; None: not rotated) and V of the
    staged blocks into the caches (fp8 staging dequantized by `scales` first)."""
    num_batch_blocks = check_scatter_args(staging, key_caches, value_caches, slot_mapping, delta_positions, src_rows,
                                          scales)
    if num_batch_blocks == 0:
        return
    _, _, num_layers, block_tokens, kv_heads, head_dim = staging.shape
    device = key_caches[0].device
    rows = staging if src_rows is None else staging[src_rows.to(staging.device)]
    rows = rows.to(device)
    if scales is not None:  # float(x) * scale + centre in float32; rotated in float32 below, rounded once at the store
        s = (scales if src_rows is None else scales[src_rows.to(scales.device)]).to(device)
        rows = rows.to(torch.float32) * s[..., 0][:, :, :, None, :, None] + s[..., 1:][:, :, :, None]
    slots = slot_mapping.to(device=device, dtype=torch.int64)
    deltas = None if delta_positions is None else delta_positions.to(device=device, dtype=torch.int64)
    keep = slots >= 0
    page_size = key_caches[0].shape[1]
    pages, offsets = slots[keep] // page_size, slots[keep] % page_size
    for layer in range(num_layers):
        k = rows[:, 0, layer].reshape(-1, kv_heads, head_dim)
        v = rows[:, 1, layer].reshape(-1, kv_heads, head_dim)
        k = k[keep] if deltas is None else rotate_keys(k[keep], deltas[keep], rope)
        key_caches[layer][pages, offsets] = k.to(key_caches[layer].dtype)
        value_caches[layer][pages, offsets] = v[keep].to(value_caches[layer].dtype)


def check_gather_args(key_caches, value_caches, slots, delta_positions, out) -> None:
    """Validate `gather_rerope`'s arguments. Raises ValueError."""
    if out.dim() != 5 or out.shape[0] != 2 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [2, layers, n, kv_heads, head_dim], got {tuple(out.shape)}")
    _, layers, n, heads, head_dim = out.shape
    if len(key_caches) != layers or len(value_caches) != layers:
        raise ValueError(f"need {layers} key and value caches, got {len(key_caches)} and {len(value_caches)}")
    for cache in (*key_caches, *value_caches):
        if cache.dim() != 4 or tuple(cache.shape[2:]) != (heads, head_dim) or cache.dtype != out.dtype:
            raise ValueError(f"cache views must be [pages, page_size, {heads}, {head_dim}] {out.dtype}, "
                             f"got {tuple(cache.shape)} {cache.dtype}")
    if slots.shape != (n,) or (delta_positions is not None and delta_positions.shape != (n,)):
        raise ValueError(f"slots / delta_positions must be [{n}]")


def gather_rerope(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    slots: torch.Tensor,
    delta_positions: torch.Tensor | None,
    rope: RopeSpec,
    out: torch.Tensor,
) -> torch.Tensor:
    """The rows at paged `slots [n]` (all >= 0) of every layer's caches into
    `out [2, layers, n, kv_heads, head_dim]` (K then V), keys rotated by
    `delta_positions [n]` with `rotate_keys` (None: copied). Returns `out`,
    the only tensor mutated."""
    check_gather_args(key_caches, value_caches, slots, delta_positions, out)
    page_size = key_caches[0].shape[1]
    slots = slots.to(device=key_caches[0].device, dtype=torch.int64)
    pages, offsets = slots // page_size, slots % page_size
    for layer, (k, v) in enumerate(zip(key_caches, value_caches)):
        keys = k[pages, offsets]
        if delta_positions is not None:
            keys = rotate_keys(keys, delta_positions.to(keys.device), rope)
        out[0, layer] = keys
        out[1, layer] = v[pages, offsets]
    return out
