"""Triton `rotate_keys`: the reference rotation (`rotate_reference.rotate_keys`) in one launch.

`rotate_keys(keys, delta_positions, rope, out=None, tables=None)` rotates
`keys [tokens, heads, head_dim]`, or `[layers, tokens, heads, head_dim]`
(every layer by the same deltas), any outer strides, head_dim contiguous, by
`delta_positions [tokens]`. The cos/sin tables are formed in
float64 and rounded to float32 exactly as the reference forms them
(`rope_cos_sin`; pass `tables` to reuse one pair for many calls with the same
deltas, e.g. every layer of a restore); the kernel rotates in float32 with
fused multiply-adds off and rounds once to the keys' dtype, so the result is
bit-identical to the reference. Dims past `rotary_dim` are copied. `out`
(same shape and dtype, head_dim contiguous) may be `keys` itself: in place.
Enqueued on the current stream; no host synchronization.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .scatter import rope_cos_sin, rope_pairs, rotary_half
from .rope_spec import RopeSpec

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # CPU debugging via Triton's interpreter


@triton.jit
def _rotate_kernel(
    X, Y, COS, SIN, num_tokens, heads, x_sl, x_st, x_sh, y_sl, y_st, y_sh,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, IS_NEOX: tl.constexpr, HAS_PASS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
):
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1).to(tl.int64)
    layer = tl.program_id(2).to(tl.int64)
    t_mask = toks < num_tokens
    toks64 = toks.to(tl.int64)
    d1, d2, _, m2, cos, sin = rope_pairs(toks, t_mask, COS, SIN, HALF, IS_NEOX, BLOCK_HALF)
    src = X + layer * x_sl + toks64 * x_st + head * x_sh
    dst = Y + layer * y_sl + toks64 * y_st + head * y_sh
    x1 = tl.load(src[:, None] + d1[None, :], mask=m2, other=0.0).to(tl.float32)
    x2 = tl.load(src[:, None] + d2[None, :], mask=m2, other=0.0).to(tl.float32)
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    DTYPE = Y.dtype.element_ty
    tl.store(dst[:, None] + d1[None, :], y1.to(DTYPE), mask=m2)
    tl.store(dst[:, None] + d2[None, :], y2.to(DTYPE), mask=m2)
    if HAS_PASS:  # dims [2 * HALF, HEAD_DIM) are not rotated
        dd = tl.arange(0, BLOCK_D)
        p_mask = t_mask[:, None] & ((dd >= 2 * HALF) & (dd < HEAD_DIM))[None, :]
        xp = tl.load(src[:, None] + dd[None, :], mask=p_mask, other=0.0)
        tl.store(dst[:, None] + dd[None, :], xp, mask=p_mask)


def rotate_keys(keys: torch.Tensor, delta_positions: torch.Tensor, rope: RopeSpec,
                out: torch.Tensor | None = None,
                tables: tuple[torch.Tensor, torch.Tensor] | None = None, block_t: int = 16) -> torch.Tensor:
    """`rotate_reference.rotate_keys` on the GPU (see the module docstring); returns `out`."""
    if keys.dim() not in (3, 4):
        raise ValueError(f"keys must be [(layers,) tokens, heads, head_dim], got {tuple(keys.shape)}")
    if delta_positions.shape != keys.shape[-3:-2]:
        raise ValueError(f"delta_positions must be [{keys.shape[-3]}], got {tuple(delta_positions.shape)}")
    if not _INTERPRET and not keys.is_cuda:
        raise ValueError("the Triton rotation needs CUDA keys")
    tokens, heads, head_dim = keys.shape[-3:]
    layers = keys.shape[0] if keys.dim() == 4 else 1
    half = rotary_half(rope, head_dim)
    out = torch.empty_like(keys) if out is None else out
    if out.shape != keys.shape or out.dtype != keys.dtype:
        raise ValueError("out must have the keys' shape and dtype")
    if tokens == 0 or heads == 0 or layers == 0:
        return out
    if keys.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("keys and out need a contiguous head_dim")
    cos, sin = tables if tables is not None else rope_cos_sin(delta_positions, rope, keys.device)
    grid = (triton.cdiv(tokens, block_t), heads, layers)
    x_sl, y_sl = (keys.stride(0), out.stride(0)) if keys.dim() == 4 else (0, 0)
    _rotate_kernel[grid](
        keys, out, cos, sin, tokens, heads, x_sl, keys.stride(-3), keys.stride(-2),
        y_sl, out.stride(-3), out.stride(-2),
        HEAD_DIM=head_dim, HALF=half, IS_NEOX=rope.is_neox_style, HAS_PASS=2 * half < head_dim,
        BLOCK_T=block_t, BLOCK_HALF=triton.next_power_of_2(max(half, 1)),
        BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4, enable_fp_fusion=False,
    )
    return out
