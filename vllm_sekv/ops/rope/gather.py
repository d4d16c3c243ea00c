"""Paged K/V caches -> one dense capture buffer, keys re-RoPE'd, in one launch.

`gather_rerope(key_caches, value_caches, slots, delta_positions, rope, out)`
reads the rows at paged `slots [n]` of every layer's key and value cache
views (`[pages, page_size, kv_heads, head_dim]`, any strides shared by all
layers, as `scatter_rerope` takes them) into `out [2, layers, n, kv_heads,
head_dim]` (contiguous; K then V, the row layout of a host slot). Keys are
rotated by `delta_positions [n]` (None: copied), bit-identical to
`rotate_reference.rotate_keys` (float64-formed cos/sin tables, float32 rotation with
fused multiply-adds off, one rounding); values are copied. Every slot must be
valid (>= 0).

The capture path uses it after a step's forward: one launch replaces two
gathers per layer inside the forward and a rotation after it. Enqueued on the
current stream; no host synchronization (the per-layer pointer tables are
built once per cache list). `scatter_reference.gather_rerope` is the
PyTorch contract the kernel is tested against.
"""
from __future__ import annotations

import os
from typing import Sequence

import torch
import triton
import triton.language as tl

from .scatter import _common_strides, _pointer_table, rope_cos_sin, rope_pairs, rotary_half
from .rope_spec import RopeSpec
from .scatter_reference import check_gather_args

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # CPU debugging via Triton's interpreter


@triton.jit
def _gather_rerope_kernel(
    OUT, SLOTS, COS, SIN, KPTRS, VPTRS, num_tokens, heads, page_size, out_kv, out_layer, out_tok,
    k_sp, k_st, k_sh, k_sd, v_sp, v_st, v_sh, v_sd,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, IS_NEOX: tl.constexpr, HAS_DELTA: tl.constexpr,
    HAS_PASS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
):
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1).to(tl.int64)
    layer = tl.program_id(2)
    t_mask = toks < num_tokens
    slots = tl.load(SLOTS + toks, mask=t_mask, other=0).to(tl.int64)
    page = slots // page_size
    off = slots % page_size
    DTYPE = OUT.dtype.element_ty
    k_src = tl.load(KPTRS + layer).to(tl.pointer_type(DTYPE)) + page * k_sp + off * k_st + head * k_sh
    v_src = tl.load(VPTRS + layer).to(tl.pointer_type(DTYPE)) + page * v_sp + off * v_st + head * v_sh
    k_dst = OUT + layer.to(tl.int64) * out_layer + toks.to(tl.int64) * out_tok + head * HEAD_DIM
    v_dst = k_dst + out_kv
    dd = tl.arange(0, BLOCK_D)
    d_mask = dd < HEAD_DIM
    m = t_mask[:, None] & d_mask[None, :]
    v = tl.load(v_src[:, None] + dd[None, :] * v_sd, mask=m, other=0.0)
    tl.store(v_dst[:, None] + dd[None, :], v, mask=m)
    if HAS_DELTA:
        d1, d2, _, m2, cos, sin = rope_pairs(toks, t_mask, COS, SIN, HALF, IS_NEOX, BLOCK_HALF)
        x1 = tl.load(k_src[:, None] + d1[None, :] * k_sd, mask=m2, other=0.0).to(tl.float32)
        x2 = tl.load(k_src[:, None] + d2[None, :] * k_sd, mask=m2, other=0.0).to(tl.float32)
        tl.store(k_dst[:, None] + d1[None, :], (x1 * cos - x2 * sin).to(DTYPE), mask=m2)
        tl.store(k_dst[:, None] + d2[None, :], (x2 * cos + x1 * sin).to(DTYPE), mask=m2)
        if HAS_PASS:  # dims [2 * HALF, HEAD_DIM) are not rotated
            p_mask = t_mask[:, None] & ((dd >= 2 * HALF) & d_mask)[None, :]
            xp = tl.load(k_src[:, None] + dd[None, :] * k_sd, mask=p_mask, other=0.0)
            tl.store(k_dst[:, None] + dd[None, :], xp, mask=p_mask)
    else:
        k = tl.load(k_src[:, None] + dd[None, :] * k_sd, mask=m, other=0.0)
        tl.store(k_dst[:, None] + dd[None, :], k, mask=m)


def gather_rerope(key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor], slots: torch.Tensor,
                  delta_positions: torch.Tensor | None, rope: RopeSpec, out: torch.Tensor,
                  block_t: int = 16) -> torch.Tensor:
    """The Triton gather (see the module docstring); returns `out`. `slots`
    and `delta_positions` must be on the caches' device already."""
    check_gather_args(key_caches, value_caches, slots, delta_positions, out)
    device = key_caches[0].device
    if not _INTERPRET and not (out.is_cuda and out.device == device):
        raise ValueError("the Triton gather needs out and caches on one CUDA device")
    _, layers, n, heads, head_dim = out.shape
    if n == 0 or layers == 0:
        return out
    half = rotary_half(rope, head_dim)
    ks = _common_strides(key_caches, "key cache")
    vs = _common_strides(value_caches, "value cache")
    cos, sin = rope_cos_sin(delta_positions, rope, device) if delta_positions is not None else (out, out)
    grid = (triton.cdiv(n, block_t), heads, layers)
    _gather_rerope_kernel[grid](
        out, slots, cos, sin, _pointer_table(key_caches), _pointer_table(value_caches),
        n, heads, key_caches[0].shape[1], out.stride(0), out.stride(1), out.stride(2),
        ks[0], ks[1], ks[2], ks[3], vs[0], vs[1], vs[2], vs[3],
        HEAD_DIM=head_dim, HALF=half, IS_NEOX=rope.is_neox_style, HAS_DELTA=delta_positions is not None,
        HAS_PASS=2 * half < head_dim, BLOCK_T=block_t, BLOCK_HALF=triton.next_power_of_2(max(half, 1)),
        BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4, enable_fp_fusion=False,
    )
    return out
