"""Triton SeKV coarse-attention merge: online softmax over segment summaries, then a
log-sum-exp merge with the view's token attention.

Same contract as `coarse_reference.coarse_merge` (formula and edge rows there). CUDA
only (or Triton's CPU interpreter with TRITON_INTERPRET=1); enqueued on the
current CUDA stream, returns without a host sync. Mutates nothing; allocates
`out` [T, Hq, D] (input dtype), `lse` [T, Hq] (float32) and, when split, a
float32 scratch of `num_splits * T * Hq * (D + 2)` values.

Fused path (`_fused_kernel`, grid [token tiles, Hq]): one program per (tile of
`block_t` query tokens, query head) loads its query tile once, streams the KV
head's summaries in tiles of `block_s` with an online softmax (base-2 logits,
float32 running max / sum / accumulator; probabilities are cast to the value
dtype for the second matrix product, as flash attention does), then loads
`out_view` / `lse_view` and merges. Rows whose running max stays -inf (no
visible summary) never divide by zero and pass `out_view` / `lse_view` through
unchanged. The q heads of a GQA group read the same summary tiles from L2.

Split path, for short query runs (decode) where token tiles x heads would leave
most multiprocessors idle: `_split_kernel` (grid [token tiles, Hq, splits])
runs the same online softmax over one contiguous range of summaries per split
and stores its (max, sum, accumulator); `_combine_kernel` (grid [token tiles,
Hq]) folds the splits together and merges as above. `CoarseConfig.num_splits`
forces a split count (1: fused); None picks one from the device's
multiprocessor count.

Cost: 4 * T * Hq * S * D FLOPs plus one exp2 per logit: compute-bound for
long prefill chunks, bound by the summaries' reads for decode.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .coarse_reference import check_coarse_args

_LOG2E = 1.4426950408889634
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # CPU debugging via Triton's interpreter


@dataclass(frozen=True)
class CoarseConfig:
    """Tile shapes (powers of two >= 16; `block_t` shrinks to fit short query
    runs) and the split count over summaries (None: automatic, 1: fused)."""

    block_t: int = 64
    block_s: int = 64
    num_warps: int = 4
    num_stages: int = 2
    num_splits: Optional[int] = None


DEFAULT_CONFIG = CoarseConfig()


@triton.jit
def _summary_softmax(Q, K, V, N, MASK, rows64, r_mask, head, kv_head, s_begin, s_end,
                     stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_mt, stride_ms,
                     qk_scale_log2, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
                     BLOCK_D: tl.constexpr, HAS_MASK: tl.constexpr, DOT_PREC: tl.constexpr):
    """Online softmax of one query tile over summaries [s_begin, s_end): returns
    (running max m [BLOCK_T], sum l [BLOCK_T], unnormalized acc [BLOCK_T, BLOCK_D]),
    base-2, float32; m = -inf and l = 0 on rows that see no summary."""
    dd = tl.arange(0, BLOCK_D)
    d_mask = dd < HEAD_DIM
    q = tl.load(Q + rows64[:, None] * stride_qt + head * stride_qh + dd[None, :],
                mask=r_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([BLOCK_T], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_T], tl.float32)
    acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    for s0 in range(s_begin, s_end, BLOCK_S):
        cols = s0 + tl.arange(0, BLOCK_S)
        c_mask = cols < s_end
        cols64 = cols.to(tl.int64)
        cd_mask = c_mask[:, None] & d_mask[None, :]
        k = tl.load(K + cols64[:, None] * stride_ks + kv_head * stride_kh + dd[None, :], mask=cd_mask, other=0.0)
        n = tl.load(N + cols, mask=c_mask, other=0).to(tl.float32)
        log_n = tl.where(n > 0.0, tl.log2(tl.where(n > 0.0, n, 1.0)), float("-inf"))
        x = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale_log2 + log_n[None, :]
        if HAS_MASK:
            vis = tl.load(MASK + rows64[:, None] * stride_mt + cols64[None, :] * stride_ms,
                          mask=r_mask[:, None] & c_mask[None, :], other=0)
            x = tl.where(vis != 0, x, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(x, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        corr = tl.exp2(m_i - m_safe)
        p = tl.exp2(x - m_safe[:, None])
        l_i = l_i * corr + tl.sum(p, 1)
        v = tl.load(V + cols64[:, None] * stride_vs + kv_head * stride_vh + dd[None, :], mask=cd_mask, other=0.0)
        acc = acc * corr[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _merge_store(m_i, l_i, acc, OV, LV, OUT, LSE, rows64, r_mask, head,
                 stride_ovt, stride_ovh, stride_lvt, stride_lvh, stride_out_t, stride_out_h, stride_lse_t,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Log-sum-exp merge of the summary softmax state with the view's (out, lse); store."""
    dd = tl.arange(0, BLOCK_D)
    rd_mask = r_mask[:, None] & (dd < HEAD_DIM)[None, :]
    has_sum = l_i > 0.0
    l_safe = tl.where(has_sum, l_i, 1.0)
    out_sum = acc / l_safe[:, None]
    lse_sum = tl.where(has_sum, m_i + tl.log2(l_safe), float("-inf"))          # log2 units
    lv_nat = tl.load(LV + rows64 * stride_lvt + head * stride_lvh, mask=r_mask, other=float("-inf"))
    ov = tl.load(OV + rows64[:, None] * stride_ovt + head * stride_ovh + dd[None, :], mask=rd_mask, other=0.0)
    ov = ov.to(tl.float32)
    has_view = lv_nat > float("-inf")
    lv = lv_nat * 1.4426950408889634
    mx = tl.where(has_view, tl.maximum(lv, lse_sum), lse_sum)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    w_view = tl.where(has_view, tl.exp2(lv - mx_safe), 0.0)
    w_sum = tl.where(has_sum, tl.exp2(lse_sum - mx_safe), 0.0)
    total = w_view + w_sum
    total_safe = tl.where(total > 0.0, total, 1.0)
    merged = (tl.where(has_view[:, None], ov, 0.0) * w_view[:, None] + out_sum * w_sum[:, None]) / total_safe[:, None]
    out = tl.where(has_sum[:, None], merged, ov)                                # exact pass-through
    lse = tl.where(has_sum, (mx_safe + tl.log2(total_safe)) * 0.6931471805599453, lv_nat)
    tl.store(OUT + rows64[:, None] * stride_out_t + head * stride_out_h + dd[None, :],
             out.to(OUT.dtype.element_ty), mask=rd_mask)
    tl.store(LSE + rows64 * stride_lse_t + head, lse, mask=r_mask)


@triton.jit
def _fused_kernel(Q, OV, LV, K, V, N, MASK, OUT, LSE, num_q, num_sum, group,
                  stride_qt, stride_qh, stride_ovt, stride_ovh, stride_lvt, stride_lvh,
                  stride_ks, stride_kh, stride_vs, stride_vh, stride_mt, stride_ms,
                  stride_out_t, stride_out_h, stride_lse_t, qk_scale_log2,
                  HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                  HAS_MASK: tl.constexpr, DOT_PREC: tl.constexpr):
    head = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    r_mask = rows < num_q
    rows64 = rows.to(tl.int64)
    m_i, l_i, acc = _summary_softmax(
        Q, K, V, N, MASK, rows64, r_mask, head, head // group, 0, num_sum,
        stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_mt, stride_ms, qk_scale_log2,
        HEAD_DIM, BLOCK_T, BLOCK_S, BLOCK_D, HAS_MASK, DOT_PREC)
    _merge_store(m_i, l_i, acc, OV, LV, OUT, LSE, rows64, r_mask, head,
                 stride_ovt, stride_ovh, stride_lvt, stride_lvh, stride_out_t, stride_out_h, stride_lse_t,
                 HEAD_DIM, BLOCK_D)


@triton.jit
def _split_kernel(Q, K, V, N, MASK, PM, PL, PACC, num_q, num_sum, group, q_heads, split_len,
                  stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_mt, stride_ms,
                  qk_scale_log2,
                  HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                  HAS_MASK: tl.constexpr, DOT_PREC: tl.constexpr):
    head = tl.program_id(1)
    split = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    r_mask = rows < num_q
    rows64 = rows.to(tl.int64)
    s_begin = split * split_len
    s_end = tl.minimum(s_begin + split_len, num_sum)
    m_i, l_i, acc = _summary_softmax(
        Q, K, V, N, MASK, rows64, r_mask, head, head // group, s_begin, s_end,
        stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_mt, stride_ms, qk_scale_log2,
        HEAD_DIM, BLOCK_T, BLOCK_S, BLOCK_D, HAS_MASK, DOT_PREC)
    row_ids = (split * num_q + rows64) * q_heads + head                          # [splits, T, Hq]
    dd = tl.arange(0, BLOCK_D)
    tl.store(PM + row_ids, m_i, mask=r_mask)
    tl.store(PL + row_ids, l_i, mask=r_mask)
    tl.store(PACC + row_ids[:, None] * BLOCK_D + dd[None, :], acc, mask=r_mask[:, None])


@triton.jit
def _combine_kernel(PM, PL, PACC, OV, LV, OUT, LSE, num_q, q_heads, num_splits,
                    stride_ovt, stride_ovh, stride_lvt, stride_lvh, stride_out_t, stride_out_h, stride_lse_t,
                    HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    head = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    r_mask = rows < num_q
    rows64 = rows.to(tl.int64)
    dd = tl.arange(0, BLOCK_D)
    m_i = tl.full([BLOCK_T], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_T], tl.float32)
    acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    for split in range(0, num_splits):
        row_ids = (split * num_q + rows64) * q_heads + head
        m_s = tl.load(PM + row_ids, mask=r_mask, other=float("-inf"))
        l_s = tl.load(PL + row_ids, mask=r_mask, other=0.0)
        a_s = tl.load(PACC + row_ids[:, None] * BLOCK_D + dd[None, :], mask=r_mask[:, None], other=0.0)
        m_new = tl.maximum(m_i, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        c_old = tl.exp2(m_i - m_safe)
        c_new = tl.exp2(m_s - m_safe)
        l_i = l_i * c_old + l_s * c_new
        acc = acc * c_old[:, None] + a_s * c_new[:, None]
        m_i = m_new
    _merge_store(m_i, l_i, acc, OV, LV, OUT, LSE, rows64, r_mask, head,
                 stride_ovt, stride_ovh, stride_lvt, stride_lvh, stride_out_t, stride_out_h, stride_lse_t,
                 HEAD_DIM, BLOCK_D)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _pick_splits(cfg: CoarseConfig, programs: int, num_sum: int, device: torch.device) -> int:
    max_splits = max(1, triton.cdiv(num_sum, cfg.block_s))
    if cfg.num_splits is not None:
        if cfg.num_splits < 1:
            raise ValueError(f"config.num_splits must be None or >= 1, got {cfg.num_splits}")
        return min(cfg.num_splits, max_splits)
    if device.type != "cuda" or max_splits < 4:
        return 1
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= sms:
        return 1
    return min(max_splits // 2, triton.cdiv(2 * sms, programs))  # >= 2 summary tiles per split


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def coarse_merge(q: torch.Tensor, out_view: torch.Tensor, lse_view: torch.Tensor, k_sum: torch.Tensor,
                 v_sum: torch.Tensor, summary_tokens: torch.Tensor, scale: Optional[float] = None,
                 mask: Optional[torch.Tensor] = None,
                 config: Optional[CoarseConfig] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `coarse_reference.coarse_merge`; same arguments and result
    (out in q's dtype, lse float32). fp16 / bf16 / fp32 inputs; tensors may be
    strided (a non-contiguous last dim is copied). Raises ValueError on bad
    shapes or dtypes and on non-CUDA tensors."""
    num_q, q_heads, kv_heads, num_sum, head_dim = check_coarse_args(
        q, out_view, lse_view, k_sum, v_sum, summary_tokens, mask)
    if not _INTERPRET and not q.is_cuda:
        raise ValueError("the Triton coarse-merge kernel needs CUDA tensors; use the reference elsewhere")
    if q.dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {q.dtype}; use one of {_DTYPES}")
    cfg = config or DEFAULT_CONFIG
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    out = torch.empty(num_q, q_heads, head_dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(num_q, q_heads, dtype=torch.float32, device=q.device)
    if num_q == 0:
        return out, lse
    q, out_view, k_sum, v_sum = (_last_dim_contiguous(x) for x in (q, out_view, k_sum, v_sum))
    if lse_view.dtype != torch.float32:
        lse_view = lse_view.to(torch.float32)
    n = summary_tokens if summary_tokens.is_contiguous() else summary_tokens.contiguous()
    if n.dtype == torch.bool:
        n = n.to(torch.int32)
    if mask is not None:
        vis = (mask if mask.dtype == torch.bool else mask != 0).view(torch.uint8)
        mask_args = (vis, vis.stride(0), vis.stride(1))
    else:
        mask_args = (n, 0, 0)  # never read
    block_t = max(16, min(cfg.block_t, triton.next_power_of_2(num_q)))
    block_d = max(16, triton.next_power_of_2(head_dim))
    t_tiles = triton.cdiv(num_q, block_t)
    common = dict(HEAD_DIM=head_dim, BLOCK_T=block_t, BLOCK_S=cfg.block_s, BLOCK_D=block_d,
                  HAS_MASK=mask is not None, DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    summary_args = (q.stride(0), q.stride(1), k_sum.stride(0), k_sum.stride(1), v_sum.stride(0), v_sum.stride(1),
                    mask_args[1], mask_args[2])
    view_args = (out_view.stride(0), out_view.stride(1), lse_view.stride(0), lse_view.stride(1),
                 out.stride(0), out.stride(1), lse.stride(0))
    splits = _pick_splits(cfg, t_tiles * q_heads, num_sum, q.device)
    if splits == 1:
        _fused_kernel[(t_tiles, q_heads)](
            q, out_view, lse_view, k_sum, v_sum, n, mask_args[0], out, lse, num_q, num_sum, q_heads // kv_heads,
            *summary_args[:2], *view_args[:4], *summary_args[2:], *view_args[4:], scale * _LOG2E, **common)
        return out, lse
    split_len = triton.cdiv(triton.cdiv(num_sum, splits), cfg.block_s) * cfg.block_s
    splits = triton.cdiv(num_sum, split_len)
    part_m = torch.empty(splits, num_q, q_heads, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(splits, num_q, q_heads, block_d, dtype=torch.float32, device=q.device)
    _split_kernel[(t_tiles, q_heads, splits)](
        q, k_sum, v_sum, n, mask_args[0], part_m, part_l, part_acc, num_q, num_sum, q_heads // kv_heads,
        q_heads, split_len, *summary_args, scale * _LOG2E, **common)
    _combine_kernel[(t_tiles, q_heads)](
        part_m, part_l, part_acc, out_view, lse_view, out, lse, num_q, q_heads, splits, *view_args,
        HEAD_DIM=head_dim, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=cfg.num_warps)
    return out, lse
