"""Triton Mean-K block scoring: two-pass online softmax over index blocks.

Same contract as `reference.score_blocks` (see there for the formula). CUDA only;
synchronous with respect to nothing: both passes are enqueued on the current
CUDA stream and the result is returned without a host sync. Mutates nothing.

Pass 1 (`_lse_kernel`, grid [row tiles, layer*kv_head]): for each query row
(q head, token) of one GQA group, stream over all valid blocks with an online
max / sum and store the row's log2-sum-exp. The q heads of a group share one
index stream, so each index tile is read once per row tile and reused from L2
by the row tiles of the same group, which run side by side.

Pass 2 (`_accum_kernel`, grid [block tiles, layer*kv_head]): each program keeps
one tile of index rows resident, streams the group's queries (L2-resident),
recomputes the logits, turns them into probabilities with the stored
log-sum-exp, accumulates them elementwise over token tiles, reduces over rows
once per q head and combines the group's heads (sum or max). A
[layer*kv_head, blocks] float32 partial is reduced by torch.

Cost: 2 x 2 * layers * q_heads * tokens * blocks * head_dim FLOPs (two passes
of the same dot products) plus one exp2 per logit per pass: compute-bound,
so its floor is the matrix-unit rate, not memory bandwidth. Measured on an
H200 (benchmarks/results/gpu/RESULTS.md): about half the dense bf16 matmul
rate at 256K-10M tokens, 21 ms at 1M and 208 ms at 10M for 512 queries of
Llama-3-8B geometry; the benchmark's tile sweep found `lse warps 4, stages 4`
about 3% faster than DEFAULT_CONFIG (within run-to-run spread).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import os

import torch
import triton
import triton.language as tl

from .reference import check_scoring_args

_LOG2E = 1.4426950408889634
# float8_e4m3fn is experimental: queries are cast to fp8 too (no scaling), which
# only suits activations well inside e4m3's range; benchmarks measure its effect.
_INDEX_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn)


_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # CPU debugging via Triton's interpreter


@dataclass(frozen=True)
class ScoringConfig:
    """Tile shapes of the two passes (each a power of two >= 16)."""

    lse_block_m: int = 128
    lse_block_n: int = 64
    lse_warps: int = 8
    lse_stages: int = 3
    acc_block_m: int = 64
    acc_block_n: int = 128
    acc_warps: int = 8
    acc_stages: int = 3
    # Experimental: exp2 of two logits per MUFU op (ex2.approx.f16x2), halving the
    # special-function work that bounds this kernel, at fp16 precision per term.
    fast_exp: bool = False


DEFAULT_CONFIG = ScoringConfig()


@triton.jit
def _exp2(x, FAST: tl.constexpr):
    if FAST:
        return tl.inline_asm_elementwise("ex2.approx.f16x2 $0, $1;", "=r,r", [x.to(tl.float16)],
                                         dtype=tl.float16, is_pure=True, pack=2).to(tl.float32)
    return tl.exp2(x)


@triton.jit
def _lse_kernel(
    Q, K, LSE, num_blocks, num_tokens, group_rows, kv_heads, q_heads, stride_kb,
    qk_scale_log2,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr, FAST_EXP: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_lg = tl.program_id(1)
    layer = pid_lg // kv_heads
    grp = pid_lg % kv_heads
    group = q_heads // kv_heads
    q_base = Q + ((layer * q_heads + grp * group) * num_tokens).to(tl.int64) * HEAD_DIM
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < group_rows
    dd = tl.arange(0, BLOCK_D)
    d_mask = dd < HEAD_DIM
    q = tl.load(q_base + rows[:, None] * HEAD_DIM + dd[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    k_base = K + (layer * kv_heads + grp) * HEAD_DIM
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    s_i = tl.zeros([BLOCK_M], tl.float32)
    for n0 in range(0, num_blocks, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        c_mask = cols < num_blocks
        k = tl.load(k_base + cols[:, None].to(tl.int64) * stride_kb + dd[None, :],
                    mask=c_mask[:, None] & d_mask[None, :], other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale_log2
        qk = tl.where(c_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        s_i = s_i * tl.exp2(m_i - m_new) + tl.sum(_exp2(qk - m_new[:, None], FAST_EXP), 1)
        m_i = m_new
    lse = m_i + tl.log2(s_i)
    tl.store(LSE + pid_lg.to(tl.int64) * group_rows + rows, lse, mask=row_mask)


@triton.jit
def _accum_kernel(
    Q, K, LSE, PART, num_blocks, part_stride, num_tokens, group_rows, kv_heads, q_heads,
    stride_kb, qk_scale_log2,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, COMBINE_MAX: tl.constexpr, DOT_PREC: tl.constexpr, FAST_EXP: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_lg = tl.program_id(1)
    layer = pid_lg // kv_heads
    grp = pid_lg % kv_heads
    group = q_heads // kv_heads
    q_base = Q + ((layer * q_heads + grp * group) * num_tokens).to(tl.int64) * HEAD_DIM
    lse_base = LSE + pid_lg.to(tl.int64) * group_rows
    dd = tl.arange(0, BLOCK_D)
    d_mask = dd < HEAD_DIM
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_mask = cols < num_blocks
    k = tl.load(K + (layer * kv_heads + grp) * HEAD_DIM + cols[:, None].to(tl.int64) * stride_kb
                + dd[None, :], mask=c_mask[:, None] & d_mask[None, :], other=0.0)
    kt = tl.trans(k)
    combined = tl.zeros([BLOCK_N], tl.float32)
    for head in range(0, group):
        # Elementwise accumulation; one reduction over rows per head, not per tile
        # (a row reduction crosses warps in the matrix-unit layout).
        acc2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for t0 in range(0, num_tokens, BLOCK_M):
            toks = t0 + tl.arange(0, BLOCK_M)
            t_mask = toks < num_tokens
            rows = head * num_tokens + toks
            q = tl.load(q_base + rows[:, None] * HEAD_DIM + dd[None, :],
                        mask=t_mask[:, None] & d_mask[None, :], other=0.0)
            lse = tl.load(lse_base + rows, mask=t_mask, other=float("inf"))
            qk = tl.dot(q, kt, input_precision=DOT_PREC) * qk_scale_log2
            acc2 += _exp2(qk - lse[:, None], FAST_EXP)
        acc = tl.sum(acc2, 0)
        if COMBINE_MAX:
            combined = tl.maximum(combined, acc)
        else:
            combined += acc
    tl.store(PART + pid_lg.to(tl.int64) * part_stride + cols, combined, mask=c_mask)


def row_log2_sum_exp(q: torch.Tensor, index: torch.Tensor, num_blocks: int, cfg: ScoringConfig) -> torch.Tensor:
    """Pass 1 alone: log2-sum-exp2 of each query row's scaled logits over the valid
    blocks, float32 [layers * kv_heads * group * tokens]. q must already be
    contiguous in the index dtype (as `score_blocks` prepares it)."""
    num_layers, q_heads, num_tokens, head_dim = q.shape
    kv_heads = index.shape[2]
    group_rows = (q_heads // kv_heads) * num_tokens
    prec = "ieee" if index.dtype == torch.float32 else "tf32"
    lse = torch.empty(num_layers * kv_heads * group_rows, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(group_rows, cfg.lse_block_m), num_layers * kv_heads)
    _lse_kernel[grid](
        q, index, lse, num_blocks, num_tokens, group_rows, kv_heads, q_heads, index.stride(0),
        _LOG2E / math.sqrt(head_dim),
        HEAD_DIM=head_dim, BLOCK_M=cfg.lse_block_m, BLOCK_N=cfg.lse_block_n, BLOCK_D=triton.next_power_of_2(head_dim),
        DOT_PREC=prec, FAST_EXP=cfg.fast_exp, num_warps=cfg.lse_warps, num_stages=cfg.lse_stages,
    )
    return lse


def score_blocks(
    queries: torch.Tensor,
    index: torch.Tensor,
    num_blocks: int | None = None,
    combine: str = "max",
    config: ScoringConfig | None = None,
) -> torch.Tensor:
    """Triton version of `reference.score_blocks`; same arguments and result.

    Queries are cast to the index dtype (fp16, bf16, fp32 or, experimental,
    float8_e4m3fn) and made contiguous;
    the index needs a contiguous last dim. `config` picks tile shapes
    (benchmarks sweep it). Raises ValueError on bad shapes, non-CUDA tensors.
    """
    num_blocks = check_scoring_args(queries, index, num_blocks, combine)
    if not _INTERPRET and not (queries.is_cuda and index.is_cuda):
        raise ValueError("the Triton scoring kernel needs CUDA tensors; use the reference elsewhere")
    if index.dtype not in _INDEX_DTYPES:
        raise ValueError(f"unsupported index dtype {index.dtype}; use one of {_INDEX_DTYPES}")
    if index.stride(3) != 1 or index.stride(1) != index.shape[2] * index.shape[3] or index.stride(2) != index.shape[3]:
        raise ValueError("index must be contiguous within a block (strides [*, H*D, D, 1])")
    cfg = config or DEFAULT_CONFIG
    num_layers, q_heads, num_tokens, head_dim = queries.shape
    kv_heads = index.shape[2]
    if num_blocks == 0 or num_tokens == 0:
        return torch.zeros(num_blocks, dtype=torch.float32, device=queries.device)
    q = queries.to(index.dtype).contiguous()
    group_rows = (q_heads // kv_heads) * num_tokens
    block_d = triton.next_power_of_2(head_dim)
    scale = _LOG2E / math.sqrt(head_dim)
    prec = "ieee" if index.dtype == torch.float32 else "tf32"
    lse = row_log2_sum_exp(q, index, num_blocks, cfg)
    part = torch.empty(num_layers * kv_heads, num_blocks, dtype=torch.float32, device=q.device)
    grid2 = (triton.cdiv(num_blocks, cfg.acc_block_n), num_layers * kv_heads)
    _accum_kernel[grid2](
        q, index, lse, part, num_blocks, part.stride(0), num_tokens, group_rows, kv_heads, q_heads,
        index.stride(0), scale,
        HEAD_DIM=head_dim, BLOCK_M=cfg.acc_block_m, BLOCK_N=cfg.acc_block_n, BLOCK_D=block_d,
        COMBINE_MAX=(combine == "max"), DOT_PREC=prec, FAST_EXP=cfg.fast_exp, num_warps=cfg.acc_warps,
        num_stages=cfg.acc_stages,
    )
    if combine == "max":
        return part.amax(dim=0)
    return part.sum(dim=0) / float(num_layers * q_heads)
