"""Triton dequantize + re-RoPE: an fp8 pool's blocks -> model-dtype K/V.

Same contract as `dequant_reference.dequantize_rerope`. One pass over the
bytes: each program reads its tokens' float8 K and V and their blocks'
parameters once, dequantizes in float32 (`float(x) * scale + centre`),
rotates the keys in float32 by the tokens' deltas and writes each value once,
rounded to the output dtype; no float32 copy of the blocks is made. Against
dequantizing in PyTorch (a float32 tensor written and read three times, then
rounded in a fourth pass) it moves about a fifth of the bytes, which matters
on a layerwise restore's path: every layer is written between the layer's
copy landing and its attention.

Bit-identical to the reference on CUDA: the same cos/sin tables
(`scatter.rope_cos_sin`, angles in float64) and the same float32 roundings
(no fused multiply-adds). Enqueued on the current stream; nothing waits for
the device. Grid: [token tiles, kv-head groups, layers].
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dequant_reference import check_dequant_args
from .rope_spec import RopeSpec
from .scatter import _INTERPRET, _TORCH_TO_TL, rope_cos_sin, rope_pairs, rotary_half


@triton.jit
def _dequant_rerope_kernel(
    KEY, VALUE, PARAMS, COS, SIN, OUT_K, OUT_V,
    num_tokens, kv_heads, row_stride, layer_stride, tok_stride, p_row, p_half, p_layer, p_head,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_TOKENS: tl.constexpr, IS_NEOX: tl.constexpr,
    HAS_ROPE: tl.constexpr, HAS_PASS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, HEADS_PER_PROG: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    layer = tl.program_id(2).to(tl.int64)
    toks = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = toks < num_tokens
    blk = (toks // BLOCK_TOKENS).to(tl.int64)
    src_tok = blk * row_stride + layer * layer_stride + (toks % BLOCK_TOKENS) * tok_stride
    dst_tok = (layer * num_tokens + toks) * (kv_heads * HEAD_DIM)  # int64: layers * tokens * heads * dims
    par_tok = PARAMS + blk * p_row + layer * p_layer
    DTYPE = OUT_K.dtype.element_ty
    dd = tl.arange(0, BLOCK_D)
    d_mask = dd < HEAD_DIM
    if HAS_ROPE:  # cos/sin loaded once per program, reused for every head
        d1, d2, i_mask, _, cos, sin = rope_pairs(toks, t_mask, COS, SIN, HALF, IS_NEOX, BLOCK_HALF)
    for hh in tl.static_range(HEADS_PER_PROG):
        head = pid_h * HEADS_PER_PROG + hh
        r_mask = t_mask & ((tl.zeros([BLOCK_T], tl.int32) + head) < kv_heads)
        src = src_tok + head * HEAD_DIM
        dst = dst_tok + head * HEAD_DIM
        sc = par_tok + head * p_head  # K: scale, centres; V: the same p_half further
        k_scale = tl.load(sc, mask=r_mask, other=1.0)
        v_scale = tl.load(sc + p_half, mask=r_mask, other=1.0)
        vm = r_mask[:, None] & d_mask[None, :]
        v = tl.load(VALUE + src[:, None] + dd[None, :], mask=vm, other=0.0).to(tl.float32)
        v = v * v_scale[:, None] + tl.load(sc[:, None] + p_half + 1 + dd[None, :], mask=vm, other=0.0)
        tl.store(OUT_V + dst[:, None] + dd[None, :], v.to(DTYPE), mask=vm)
        if HAS_ROPE:
            lm = r_mask[:, None] & i_mask[None, :]
            x1 = tl.load(KEY + src[:, None] + d1[None, :], mask=lm, other=0.0).to(tl.float32)
            x2 = tl.load(KEY + src[:, None] + d2[None, :], mask=lm, other=0.0).to(tl.float32)
            x1 = x1 * k_scale[:, None] + tl.load(sc[:, None] + 1 + d1[None, :], mask=lm, other=0.0)
            x2 = x2 * k_scale[:, None] + tl.load(sc[:, None] + 1 + d2[None, :], mask=lm, other=0.0)
            y1 = x1 * cos - x2 * sin
            y2 = x2 * cos + x1 * sin
            tl.store(OUT_K + dst[:, None] + d1[None, :], y1.to(DTYPE), mask=lm)
            tl.store(OUT_K + dst[:, None] + d2[None, :], y2.to(DTYPE), mask=lm)
            if HAS_PASS:  # dims [2*HALF, HEAD_DIM) are not rotated
                pm = r_mask[:, None] & ((dd >= 2 * HALF) & d_mask)[None, :]
                xp = tl.load(KEY + src[:, None] + dd[None, :], mask=pm, other=0.0).to(tl.float32)
                xp = xp * k_scale[:, None] + tl.load(sc[:, None] + 1 + dd[None, :], mask=pm, other=0.0)
                tl.store(OUT_K + dst[:, None] + dd[None, :], xp.to(DTYPE), mask=pm)
        else:
            k = tl.load(KEY + src[:, None] + dd[None, :], mask=vm, other=0.0).to(tl.float32)
            k = k * k_scale[:, None] + tl.load(sc[:, None] + 1 + dd[None, :], mask=vm, other=0.0)
            tl.store(OUT_K + dst[:, None] + dd[None, :], k.to(DTYPE), mask=vm)


def dequantize_rerope(key: torch.Tensor, value: torch.Tensor, params: torch.Tensor,
                      delta_positions: torch.Tensor | None, rope: RopeSpec, dtype: torch.dtype,
                      block_t: int = 32, heads_per_prog: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `dequant_reference.dequantize_rerope` (same arguments).

    key, value and params must be on one CUDA device, key and value with the
    same strides and each token's `[kv_heads, head_dim]` contiguous, params
    with its last dim contiguous; delta_positions on that device too (a copy
    from the host would wait for the stream)."""
    check_dequant_args(key, value, params, delta_positions)
    device = key.device
    if not _INTERPRET and not (key.is_cuda and value.device == device and params.device == device):
        raise ValueError("the Triton dequantize needs key, value and params on one CUDA device")
    if dtype not in _TORCH_TO_TL:
        raise ValueError(f"unsupported dtype {dtype}")
    n, layers, block_tokens, kv_heads, head_dim = key.shape
    if value.stride() != key.stride() or key.stride(4) != 1 or key.stride(3) != head_dim or params.stride(4) != 1:
        raise ValueError("key and value need the same strides with [kv_heads, head_dim] contiguous, "
                         "params its last dim contiguous")
    num_tokens = n * block_tokens
    keys = torch.empty((layers, num_tokens, kv_heads, head_dim), dtype=dtype, device=device)
    values = torch.empty_like(keys)
    if num_tokens == 0 or layers == 0:
        return keys, values
    has_rope = delta_positions is not None
    half = rotary_half(rope, head_dim) if has_rope else head_dim // 2
    cos, sin = rope_cos_sin(delta_positions, rope, device) if has_rope else (params, params)  # unused without rope
    heads_per_prog = max(1, min(heads_per_prog, kv_heads))
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(kv_heads, heads_per_prog), layers)
    _dequant_rerope_kernel[grid](
        key, value, params, cos, sin, keys, values,
        num_tokens, kv_heads, key.stride(0), key.stride(1), key.stride(2), *params.stride()[:4],
        HEAD_DIM=head_dim, HALF=half, BLOCK_TOKENS=block_tokens, IS_NEOX=has_rope and rope.is_neox_style,
        HAS_ROPE=has_rope, HAS_PASS=2 * half < head_dim,
        BLOCK_T=block_t, BLOCK_HALF=triton.next_power_of_2(max(half, 1)),
        BLOCK_D=triton.next_power_of_2(head_dim), HEADS_PER_PROG=heads_per_prog, num_warps=4,
        enable_fp_fusion=False,  # no FMA: the same float32 roundings as the reference
    )
    return keys, values
