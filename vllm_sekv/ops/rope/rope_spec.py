"""The served model's RoPE as a pure rotation: what every re-RoPE needs.

Built from the model at start-up (`vllm_sekv.model_identity.rope_spec`);
read by the rotation, scatter and gather kernels and their references.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeSpec:
    """What a pure rotation needs to know about the served model's RoPE.

    inv_freq: [rotary_dim // 2] effective inverse frequencies (float64), i.e. the
        angle of pair i at position p is `p * inv_freq[i]`.
    rotary_dim: number of leading head dims that are rotated (<= head_dim).
    is_neox_style: True for rotate-half pairs (i, i + rotary_dim/2), False for
        interleaved pairs (2i, 2i+1).
    """

    inv_freq: torch.Tensor
    rotary_dim: int
    is_neox_style: bool = True


# Device copies of RopeSpec.inv_freq: a host->device copy per rotation would
# synchronize the stream (rotations run once per layer inside the forward).
# Keyed by the source tensor's id, which the entry keeps alive.
_INV_FREQ_ON: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def inv_freq_on(rope: RopeSpec, device: torch.device) -> torch.Tensor:
    """`rope.inv_freq` as float64 on `device`, copied there once: a copy from
    pageable host memory makes the host wait for every kernel queued on the
    stream, which code inside the forward pass must never do."""
    src = rope.inv_freq
    if src.device == device:
        return src.to(torch.float64)
    key = (id(src), device)
    hit = _INV_FREQ_ON.get(key)
    if hit is None or hit[0] is not src:
        hit = _INV_FREQ_ON[key] = (src, src.to(device=device, dtype=torch.float64))
    return hit[1]
