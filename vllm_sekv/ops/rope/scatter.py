"""Triton scatter + re-RoPE: packed staging blocks -> paged K/V caches.

Same contract as `scatter_reference.scatter_rerope` (layouts, slot -1 = skip,
what is mutated). Enqueued on the current CUDA stream; no host sync except
building the per-layer pointer tables (two tiny H2D copies, cached per cache
list). One launch covers all layers: the per-layer cache base addresses are
passed as int64 tables, so all key views must share one stride set and all
value views another (true for vLLM's per-layer caches).

`delta_positions` None: keys are not moved, the kernel copies them as it
copies values (`HAS_DELTA` off): bit for bit, where a rotation by zero
could turn a -0.0 into +0.0.

Angles are formed once per batch token in float64 (torch, as `rotate_keys`
does) and passed as float32 cos/sin tables [tokens, rotary_dim/2]; the kernel
rotates in float32 and rounds once to the cache dtype. The table costs
`rotary_dim * 4` bytes per token against `num_layers * kv_heads * head_dim * 4`
bytes of K/V moved, i.e. well under 1% of the traffic.

With `scales` (an fp8 host pool's parameters, `store.fp8`): the staging
buffer holds float8 e4m3; the kernel loads each token's K and V scale and
per-channel centres of its (staging row, layer, head), dequantizes in float32
(`float(x) * scale + centre`), rotates the keys
in float32 and rounds once to the caches' dtype, as the reference does. One
extra pointer and a constexpr flag (`HAS_SCALES`); without it the code path is
the exact one (V and pass-through dims copied bit for bit).

Grid: [token tiles, kv-head groups of `heads_per_prog`, layers]; a program
loads its tokens' cos/sin once and reuses them for its heads. Memory-bound:
reads the staged K/V once and writes each byte once.
"""
from __future__ import annotations

from typing import Sequence

import os

import torch
import triton
import triton.language as tl

from .rope_spec import RopeSpec, inv_freq_on
from .scatter_reference import check_scatter_args

_TORCH_TO_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def rope_cos_sin(delta_positions: torch.Tensor, rope: RopeSpec, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos/sin tables [tokens, rotary_dim/2] of `delta * inv_freq` formed in float64.
    Never waits for the device (`delta_positions` must be on it already)."""
    inv_freq = inv_freq_on(rope, device)
    angles = delta_positions.to(device=device, dtype=torch.float64)[:, None] * inv_freq
    return angles.cos().to(torch.float32).contiguous(), angles.sin().to(torch.float32).contiguous()


_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # CPU debugging via Triton's interpreter


def rotary_half(rope: RopeSpec, head_dim: int) -> int:
    """Half the rope's rotary dims (the kernels' HALF); ValueError if it does
    not fit `head_dim` (odd or too many rotary dims, inv_freq of another size)."""
    rd = rope.rotary_dim
    if rd % 2 or rd > head_dim or rope.inv_freq.numel() != rd // 2:
        raise ValueError(f"rotary_dim {rd} / inv_freq {rope.inv_freq.numel()} do not fit head_dim {head_dim}")
    return rd // 2


@triton.jit
def rope_pairs(toks, t_mask, COS, SIN, HALF: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """The rotation's pairs of dims, (i, i + HALF) (neox) or (2i, 2i + 1)
    (interleaved), for `toks [BLOCK_T]` (valid where `t_mask`): (d1, d2
    [BLOCK_HALF], their mask, the [BLOCK_T, BLOCK_HALF] mask, cos, sin)."""
    ii = tl.arange(0, BLOCK_HALF)
    i_mask = ii < HALF
    if IS_NEOX:
        d1 = ii
        d2 = ii + HALF
    else:
        d1 = 2 * ii
        d2 = 2 * ii + 1
    m2 = t_mask[:, None] & i_mask[None, :]
    cs = toks[:, None].to(tl.int64) * HALF + ii[None, :]
    cos = tl.load(COS + cs, mask=m2, other=1.0)
    sin = tl.load(SIN + cs, mask=m2, other=0.0)
    return d1, d2, i_mask, m2, cos, sin


@triton.jit
def _scatter_rerope_kernel(
    STAGING, SRC_ROWS, SLOTS, COS, SIN, KPTRS, VPTRS, CACHE_REF, SCALES,
    num_tokens, kv_heads, page_size, row_stride, half_stride, layer_stride, tok_stride,
    k_sp, k_st, k_sh, k_sd, v_sp, v_st, v_sh, v_sd, sc_row, sc_half, sc_layer, sc_head,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_TOKENS: tl.constexpr,
    IS_NEOX: tl.constexpr, HAS_DELTA: tl.constexpr, HAS_SRC_ROWS: tl.constexpr, HAS_PASS: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, HEADS_PER_PROG: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    layer = tl.program_id(2)
    toks = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = toks < num_tokens
    slots = tl.load(SLOTS + toks, mask=t_mask, other=-1).to(tl.int64)
    w_mask = t_mask & (slots >= 0)
    page = slots // page_size
    off = slots % page_size
    blk = toks // BLOCK_TOKENS
    if HAS_SRC_ROWS:
        blk = tl.load(SRC_ROWS + blk, mask=t_mask, other=0)
    blk = blk.to(tl.int64)
    src_tok = STAGING + blk * row_stride + layer * layer_stride + (toks % BLOCK_TOKENS) * tok_stride
    DTYPE = CACHE_REF.dtype.element_ty  # the caches' dtype (the staging's unless HAS_SCALES)
    k_base = tl.load(KPTRS + layer).to(tl.pointer_type(DTYPE))
    v_base = tl.load(VPTRS + layer).to(tl.pointer_type(DTYPE))
    k_tok = k_base + page * k_sp + off * k_st
    v_tok = v_base + page * v_sp + off * v_st

    dd = tl.arange(0, BLOCK_D)
    d_mask = dd < HEAD_DIM
    if HAS_DELTA:  # cos/sin loaded once per program, reused for every head
        d1, d2, i_mask, _, cos, sin = rope_pairs(toks, t_mask, COS, SIN, HALF, IS_NEOX, BLOCK_HALF)
    for hh in tl.static_range(HEADS_PER_PROG):
        head = pid_h * HEADS_PER_PROG + hh
        h_ok = (tl.zeros([BLOCK_T], tl.int32) + head) < kv_heads
        r_mask = t_mask & h_ok  # rows to read
        s_mask = w_mask & h_ok  # rows to write
        src = src_tok + head * HEAD_DIM
        k_dst = k_tok + head * k_sh
        v_dst = v_tok + head * v_sh
        vm = r_mask[:, None] & d_mask[None, :]
        if HAS_SCALES:  # fp8 staging: scale, then centres, of (row, K / V, layer, head) per token
            sc = SCALES + blk * sc_row + layer * sc_layer + head * sc_head
            k_scale = tl.load(sc, mask=r_mask, other=1.0)
            v_scale = tl.load(sc + sc_half, mask=r_mask, other=1.0)
        if HAS_DELTA:
            lm = r_mask[:, None] & i_mask[None, :]
            x1 = tl.load(src[:, None] + d1[None, :], mask=lm, other=0.0).to(tl.float32)
            x2 = tl.load(src[:, None] + d2[None, :], mask=lm, other=0.0).to(tl.float32)
            if HAS_SCALES:
                x1 = x1 * k_scale[:, None] + tl.load(sc[:, None] + 1 + d1[None, :], mask=lm, other=0.0)
                x2 = x2 * k_scale[:, None] + tl.load(sc[:, None] + 1 + d2[None, :], mask=lm, other=0.0)
            y1 = x1 * cos - x2 * sin
            y2 = x2 * cos + x1 * sin
            wm = s_mask[:, None] & i_mask[None, :]
            tl.store(k_dst[:, None] + d1[None, :] * k_sd, y1.to(DTYPE), mask=wm)
            tl.store(k_dst[:, None] + d2[None, :] * k_sd, y2.to(DTYPE), mask=wm)
            if HAS_PASS:  # dims [2*HALF, HEAD_DIM) are not rotated
                p_mask = (dd >= 2 * HALF) & d_mask
                pm = r_mask[:, None] & p_mask[None, :]
                xp = tl.load(src[:, None] + dd[None, :], mask=pm, other=0.0)
                if HAS_SCALES:
                    xp = xp.to(tl.float32) * k_scale[:, None] + tl.load(sc[:, None] + 1 + dd[None, :], mask=pm,
                                                                       other=0.0)
                    xp = xp.to(DTYPE)
                tl.store(k_dst[:, None] + dd[None, :] * k_sd, xp, mask=s_mask[:, None] & p_mask[None, :])
        else:  # keys not moved: copied as they are (fp8: dequantized, rounded once to the cache dtype)
            k = tl.load(src[:, None] + dd[None, :], mask=vm, other=0.0)
            if HAS_SCALES:
                k = (k.to(tl.float32) * k_scale[:, None] + tl.load(sc[:, None] + 1 + dd[None, :], mask=vm,
                                                                   other=0.0)).to(DTYPE)
            tl.store(k_dst[:, None] + dd[None, :] * k_sd, k, mask=s_mask[:, None] & d_mask[None, :])
        # V: plain copy (fp8: dequantized, rounded once to the cache dtype).
        v = tl.load(src[:, None] + half_stride + dd[None, :], mask=vm, other=0.0)
        if HAS_SCALES:
            v_centre = tl.load(sc[:, None] + sc_half + 1 + dd[None, :], mask=vm, other=0.0)
            v = (v.to(tl.float32) * v_scale[:, None] + v_centre).to(DTYPE)
        tl.store(v_dst[:, None] + dd[None, :] * v_sd, v, mask=s_mask[:, None] & d_mask[None, :])


_PTR_TABLES: dict[tuple, torch.Tensor] = {}


def _pointer_table(caches: Sequence[torch.Tensor]) -> torch.Tensor:
    key = tuple(c.data_ptr() for c in caches) + (caches[0].device.index,)
    table = _PTR_TABLES.get(key)
    if table is None:
        table = torch.tensor(list(key[:-1]), dtype=torch.int64, device=caches[0].device)
        if len(_PTR_TABLES) > 64:
            _PTR_TABLES.clear()
        _PTR_TABLES[key] = table
    return table


def _common_strides(caches: Sequence[torch.Tensor], what: str) -> tuple[int, ...]:
    strides = caches[0].stride()
    for c in caches[1:]:
        if c.stride() != strides or c.shape != caches[0].shape:
            raise ValueError(f"all {what} views must share shape and strides")
    return strides


def scatter_rerope(
    staging: torch.Tensor,
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    slot_mapping: torch.Tensor,
    delta_positions: torch.Tensor | None,
    rope: RopeSpec,
    src_rows: torch.Tensor | None = None,
    block_t: int = 32,
    heads_per_prog: int = 8,
    scales: torch.Tensor | None = None,
) -> None:
    """Triton version of `scatter_reference.scatter_rerope` (same arguments).

    staging must be a contiguous CUDA tensor on the caches' device; slot_mapping,
    delta_positions and src_rows are moved to that device if needed (a copy,
    possibly blocking if they live in pageable host memory).
    """
    num_batch_blocks = check_scatter_args(staging, key_caches, value_caches, slot_mapping, delta_positions, src_rows,
                                          scales)
    if num_batch_blocks == 0:
        return
    device = key_caches[0].device
    if not _INTERPRET and not (staging.is_cuda and device == staging.device):
        raise ValueError("the Triton scatter needs staging and caches on one CUDA device")
    if not staging.is_contiguous():
        raise ValueError("staging must be contiguous")
    if key_caches[0].dtype not in _TORCH_TO_TL:
        raise ValueError(f"unsupported dtype {key_caches[0].dtype}")
    if scales is not None:
        scales = scales.to(device=device, dtype=torch.float32, non_blocking=True).contiguous()
    _, _, num_layers, block_tokens, kv_heads, head_dim = staging.shape
    half = rotary_half(rope, head_dim)
    ks = _common_strides(key_caches, "key cache")
    vs = _common_strides(value_caches, "value cache")
    num_tokens = num_batch_blocks * block_tokens
    slots = slot_mapping.to(device=device, dtype=torch.int64, non_blocking=True)
    # without deltas the kernel reads no cos/sin (`HAS_DELTA` off): any device tensor stands in for them
    cos, sin = rope_cos_sin(delta_positions, rope, device) if delta_positions is not None else (slots, slots)
    rows = None if src_rows is None else src_rows.to(device=device, dtype=torch.int64, non_blocking=True)
    heads_per_prog = max(1, min(heads_per_prog, kv_heads))
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(kv_heads, heads_per_prog), num_layers)
    _scatter_rerope_kernel[grid](
        staging, rows if rows is not None else slots, slots, cos, sin,
        _pointer_table(key_caches), _pointer_table(value_caches), key_caches[0],
        scales if scales is not None else cos,
        num_tokens, kv_heads, key_caches[0].shape[1], *staging.stride()[:4],
        ks[0], ks[1], ks[2], ks[3], vs[0], vs[1], vs[2], vs[3],
        *(scales.stride()[:4] if scales is not None else (0, 0, 0, 0)),
        HEAD_DIM=head_dim, HALF=half, BLOCK_TOKENS=block_tokens,
        IS_NEOX=rope.is_neox_style, HAS_DELTA=delta_positions is not None, HAS_SRC_ROWS=rows is not None,
        HAS_PASS=2 * half < head_dim, HAS_SCALES=scales is not None,
        BLOCK_T=block_t, BLOCK_HALF=triton.next_power_of_2(max(half, 1)),
        BLOCK_D=triton.next_power_of_2(head_dim), HEADS_PER_PROG=heads_per_prog, num_warps=4,
        enable_fp_fusion=False,  # no FMA: the same float32 roundings as the reference
    )
