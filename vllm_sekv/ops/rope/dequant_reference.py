"""PyTorch reference for an fp8 pool's blocks -> model-dtype K/V, keys re-RoPE'd.

Source: the K and V of `n` blocks of an fp8 host pool (`workspace_codec` fp8,
`store.fp8`), each `[n, layers, block_tokens, kv_heads, head_dim]` float8
e4m3 (any strides), and their parameters `params [n, 2, layers, kv_heads,
1 + head_dim]` float32 (per block, K or V, layer and head: a scale, then a
centre per channel). Element x of K (params[:, 0]) or V (params[:, 1]) reads
back as `float(x) * scale + centre` in float32.

Result: `(keys, values)`, each a new contiguous `[layers, n * block_tokens,
kv_heads, head_dim]` tensor in `dtype`; token `j * block_tokens + i` is block
j's token i. Keys are rotated in float32 by `delta_positions [n *
block_tokens]` (`rotate_reference.rotate_keys`; None: not rotated), and every
value is rounded to `dtype` once, at the end. Nothing is mutated.
"""
from __future__ import annotations

import torch

from .rope_spec import RopeSpec
from .rotate_reference import rotate_keys


def check_dequant_args(key: torch.Tensor, value: torch.Tensor, params: torch.Tensor,
                       delta_positions: torch.Tensor | None) -> None:
    """Validate `dequantize_rerope`'s arguments. Raises ValueError."""
    if key.dim() != 5 or value.shape != key.shape:
        raise ValueError(f"key and value must both be [n, layers, block_tokens, kv_heads, head_dim], "
                         f"got {tuple(key.shape)} and {tuple(value.shape)}")
    if key.dtype != torch.float8_e4m3fn or value.dtype != key.dtype:
        raise ValueError(f"key and value must be float8_e4m3fn, got {key.dtype} and {value.dtype}")
    n, layers, block_tokens, kv_heads, head_dim = key.shape
    want = (n, 2, layers, kv_heads, 1 + head_dim)
    if tuple(params.shape) != want or params.dtype != torch.float32:
        raise ValueError(f"params must be float32 {list(want)}, got {params.dtype} {list(params.shape)}")
    if delta_positions is not None and delta_positions.shape != (n * block_tokens,):
        raise ValueError(f"delta_positions must be [{n * block_tokens}], got {tuple(delta_positions.shape)}")


def dequantize_rerope(key: torch.Tensor, value: torch.Tensor, params: torch.Tensor,
                      delta_positions: torch.Tensor | None, rope: RopeSpec,
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) `[layers, tokens, kv_heads, head_dim]` in `dtype`: the
    blocks dequantized in float32, keys rotated by `delta_positions`, rounded once."""
    check_dequant_args(key, value, params, delta_positions)
    n, layers, block_tokens, kv_heads, head_dim = key.shape
    params = params.to(key.device)

    def read(x: torch.Tensor, kv: int) -> torch.Tensor:
        scale = params[:, kv, :, None, :, :1]  # [n, layers, 1, kv_heads, 1]
        centre = params[:, kv, :, None, :, 1:]  # [n, layers, 1, kv_heads, head_dim]
        y = x.to(torch.float32) * scale + centre
        return y.transpose(0, 1).reshape(layers, n * block_tokens, kv_heads, head_dim)

    keys, values = read(key, 0), read(value, 1)
    if delta_positions is not None:
        keys = torch.stack([rotate_keys(keys[layer], delta_positions, rope) for layer in range(layers)])
    return keys.to(dtype), values.to(dtype)
