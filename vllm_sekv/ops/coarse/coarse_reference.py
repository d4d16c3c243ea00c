"""PyTorch reference for the SeKV coarse-attention merge (same signature as `coarse_kernel.py`).

Token-level attention over the view gave, per query token t and query head h,
`out_view[t, h]` and its natural-log log-sum-exp `lse_view[t, h]` over the
*scaled* logits. Segments that are not expanded are present only as summaries
(`vllm_sekv.workspace.segment_summaries`): summary s of KV head g is one
pseudo-key `k_sum[s, g]` with value `v_sum[s, g]` standing for `n[s]` tokens,
i.e. n[s] identical keys:

    logit[t, h, s] = scale * q[t, h] . k_sum[s, g] + log n[s]     (g = h // (Hq // H))
    lse_sum        = logsumexp_s logit          (over visible s with n[s] > 0)
    out_sum        = sum_s softmax_s(logit) v_sum[s, g]
    lse            = logaddexp(lse_view, lse_sum)
    out            = exp(lse_view - lse) out_view + exp(lse_sum - lse) out_sum

A summary is visible to query t when `mask[t, s]` is nonzero (default: all) and
`n[s] > 0`; `n[s] <= 0` (e.g. a segment that is only its anchor) stands for
nothing. Edge rows: no visible summary (also S = 0) -> `out = out_view` and
`lse = lse_view`, exactly (bit for bit, even when lse_view is -inf);
`lse_view = -inf` (no view key visible) -> the summary attention alone,
whatever `out_view` holds (NaN included). `q` and `k_sum` must be rotated as the attention uses them (the
summary at whatever position the caller assigns it).

Arithmetic in float32 (float64 for float64 inputs), any device. `out` comes
back in the input dtype, `lse` in float32 (float64 for float64 inputs). Pure:
mutates nothing. Raises ValueError on bad shapes, dtypes or devices.

`attention_with_lse` (exact attention returning (out, lse)) is a test helper:
it states what the merge must reproduce.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_coarse_args(q: Tensor, out_view: Tensor, lse_view: Tensor, k_sum: Tensor, v_sum: Tensor,
                      summary_tokens: Tensor, mask: Optional[Tensor]) -> tuple[int, int, int, int, int]:
    """Validate the merge's arguments; return (T, Hq, H, S, D). Raises ValueError."""
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got {tuple(q.shape)}")
    num_q, q_heads, head_dim = q.shape
    if out_view.shape != q.shape:
        raise ValueError(f"out_view must be {tuple(q.shape)} like q, got {tuple(out_view.shape)}")
    if lse_view.shape != (num_q, q_heads):
        raise ValueError(f"lse_view must be [T, Hq] = [{num_q}, {q_heads}], got {tuple(lse_view.shape)}")
    if k_sum.dim() != 3 or k_sum.shape[2] != head_dim:
        raise ValueError(f"k_sum must be [S, H, {head_dim}], got {tuple(k_sum.shape)}")
    num_sum, kv_heads, _ = k_sum.shape
    if v_sum.shape != k_sum.shape:
        raise ValueError(f"v_sum must be {tuple(k_sum.shape)} like k_sum, got {tuple(v_sum.shape)}")
    if kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(f"q heads ({q_heads}) must be a multiple of k_sum heads ({kv_heads})")
    if summary_tokens.shape != (num_sum,):
        raise ValueError(f"summary_tokens must be [S] = [{num_sum}], got {tuple(summary_tokens.shape)}")
    if mask is not None and mask.shape != (num_q, num_sum):
        raise ValueError(f"mask must be [T, S] = [{num_q}, {num_sum}], got {tuple(mask.shape)}")
    for name, x in (("q", q), ("out_view", out_view), ("k_sum", k_sum), ("v_sum", v_sum)):
        if x.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {x.dtype}; q, out_view, k_sum and v_sum must share one dtype")
    if q.dtype not in _FLOAT_DTYPES or not lse_view.is_floating_point():
        raise ValueError(f"q must be one of {_FLOAT_DTYPES} and lse_view floating point")
    if mask is not None and (mask.is_floating_point() or mask.is_complex()):
        raise ValueError(f"mask must be bool or integer, got {mask.dtype}")
    tensors = {"out_view": out_view, "lse_view": lse_view, "k_sum": k_sum, "v_sum": v_sum,
               "summary_tokens": summary_tokens, "mask": mask}
    for name, x in tensors.items():
        if x is not None and x.device != q.device:
            raise ValueError(f"{name} is on {x.device}, q on {q.device}: all must share one device")
    return num_q, q_heads, kv_heads, num_sum, head_dim


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def coarse_merge(q: Tensor, out_view: Tensor, lse_view: Tensor, k_sum: Tensor, v_sum: Tensor,
                 summary_tokens: Tensor, scale: Optional[float] = None,
                 mask: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Merge token attention over the view with attention over segment summaries.

    q, out_view: [T, Hq, D]; lse_view: [T, Hq]; k_sum, v_sum: [S, H, D];
    summary_tokens: [S] (n_s, int or float); scale: default 1/sqrt(D);
    mask: [T, S] bool/int or None. Returns (out [T, Hq, D] in q's dtype, lse [T, Hq]).
    """
    num_q, q_heads, kv_heads, num_sum, head_dim = check_coarse_args(
        q, out_view, lse_view, k_sum, v_sum, summary_tokens, mask)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    cd = _compute_dtype(q.dtype)
    lv = lse_view.to(cd)
    ov = out_view.to(cd)
    if num_sum == 0 or num_q == 0:
        return out_view.clone(), lv.clone()
    group = q_heads // kv_heads
    n = summary_tokens.to(cd)
    log_n = torch.where(n > 0, torch.log(torch.where(n > 0, n, 1.0)), float("-inf"))
    k = k_sum.to(cd).repeat_interleave(group, dim=1)                       # [S, Hq, D]
    v = v_sum.to(cd).repeat_interleave(group, dim=1)
    logits = torch.einsum("thd,shd->ths", q.to(cd), k) * scale + log_n     # [T, Hq, S]
    if mask is not None:
        logits = logits.masked_fill(~mask.bool()[:, None, :], float("-inf"))
    lse_sum = torch.logsumexp(logits, dim=-1)                              # -inf: nothing visible
    has_sum = lse_sum > float("-inf")
    p = torch.exp(logits - torch.where(has_sum, lse_sum, 0.0)[..., None])
    out_sum = torch.einsum("ths,shd->thd", p, v)
    has_view = lv > float("-inf")
    lse = torch.logaddexp(lv, lse_sum)
    lse_safe = torch.where(lse > float("-inf"), lse, 0.0)
    w_view = torch.where(has_view, torch.exp(lv - lse_safe), 0.0)
    w_sum = torch.where(has_sum, torch.exp(lse_sum - lse_safe), 0.0)
    out = w_view[..., None] * torch.where(has_view[..., None], ov, 0.0) + w_sum[..., None] * out_sum
    out = torch.where(has_sum[..., None], out, ov)                         # exact pass-through
    lse = torch.where(has_sum, lse, lv)
    return out.to(q.dtype), lse


def attention_with_lse(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float] = None,
                       causal_offset: Optional[int] = None,
                       mask: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Exact softmax attention with its log-sum-exp (test helper).

    q: [T, Hq, D]; k, v: [N, H, D] (GQA as above). Query t sees key j iff
    ``j <= causal_offset + t`` (when causal_offset is given) and ``mask[t, j]``
    (when mask [T, N] is given). Returns (out [T, Hq, D], lse [T, Hq]) in float32
    (float64 for float64 inputs); a row that sees no key gets out 0, lse -inf.
    """
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or k.shape[2] != q.shape[2]:
        raise ValueError(f"q must be [T, Hq, D] and k, v [N, H, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    num_q, q_heads, head_dim = q.shape
    num_k, kv_heads, _ = k.shape
    if kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(f"q heads ({q_heads}) must be a multiple of k heads ({kv_heads})")
    if mask is not None and mask.shape != (num_q, num_k):
        raise ValueError(f"mask must be [T, N] = [{num_q}, {num_k}], got {tuple(mask.shape)}")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    cd = _compute_dtype(q.dtype)
    group = q_heads // kv_heads
    kk = k.to(cd).repeat_interleave(group, dim=1)
    vv = v.to(cd).repeat_interleave(group, dim=1)
    logits = torch.einsum("thd,nhd->thn", q.to(cd), kk) * scale
    visible = torch.ones(num_q, num_k, dtype=torch.bool, device=q.device)
    if causal_offset is not None:
        pos = torch.arange(num_q, device=q.device)[:, None] + int(causal_offset)
        visible &= torch.arange(num_k, device=q.device)[None, :] <= pos
    if mask is not None:
        visible &= mask.to(q.device).bool()
    logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    has = lse > float("-inf")
    p = torch.exp(logits - torch.where(has, lse, 0.0)[..., None])
    return torch.einsum("thn,nhd->thd", p, vv), lse
