"""PyTorch reference for moving rotary-embedded keys to new positions.

A key stored after RoPE at position p is moved to p' by one more rotation by
(p' - p), built from the model's (possibly scaled) inverse frequencies. This is
exact in real arithmetic for every rope type whose embedding at p is
`scale * R(p * inv_freq)`: default, linear (scaled inv_freq), llama3 (smoothed
inv_freq) and yarn (interpolated inv_freq, `mscale` already inside the key).
Never re-apply vLLM's cached cos/sin to an already rotated key.

Angles are formed in float64 so that large position deltas stay accurate; the
rotation itself runs in float32 and the result is cast back to the key dtype.
"""
from __future__ import annotations

import torch

from .rope_spec import RopeSpec, inv_freq_on


def rotate_keys(keys: torch.Tensor, delta_positions: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    """Rotate `keys` [tokens, heads, head_dim] by `delta_positions` [tokens].

    Returns a new tensor of the same dtype; `keys` is not modified. A negative
    delta de-rotates (e.g. delta = -p gives the pre-RoPE key, up to a yarn
    mscale factor). `delta_positions` on another device than `keys` is copied
    over (synchronously on CUDA): pass them on the keys' device in hot paths.
    """
    if keys.dim() != 3:
        raise ValueError(f"keys must be [tokens, heads, head_dim], got {tuple(keys.shape)}")
    if delta_positions.shape != keys.shape[:1]:
        raise ValueError(
            f"delta_positions must be [{keys.shape[0]}], got {tuple(delta_positions.shape)}"
        )
    rd = rope.rotary_dim
    inv_freq = inv_freq_on(rope, keys.device)
    angles = delta_positions.to(device=keys.device, dtype=torch.float64)[:, None] * inv_freq
    cos = angles.cos().to(torch.float32)[:, None, :]  # [T, 1, rd/2]
    sin = angles.sin().to(torch.float32)[:, None, :]
    out = keys.to(torch.float32)  # a copy unless keys are float32
    if out is keys:
        out = out.clone()
    rot = out[..., :rd]
    if rope.is_neox_style:
        x1, x2 = rot[..., : rd // 2].clone(), rot[..., rd // 2 :].clone()
        rot[..., : rd // 2] = x1 * cos - x2 * sin
        rot[..., rd // 2 :] = x2 * cos + x1 * sin
    else:
        x1, x2 = rot[..., 0::2].clone(), rot[..., 1::2].clone()
        rot[..., 0::2] = x1 * cos - x2 * sin
        rot[..., 1::2] = x2 * cos + x1 * sin
    return out.to(keys.dtype)
