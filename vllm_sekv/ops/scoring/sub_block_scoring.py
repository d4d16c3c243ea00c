"""Triton sub-block scoring: `BlockIndex.score` for logsumexp summary kinds.

Contract (`score_sub_blocks(queries, entries, layer, slots, valid) -> Tensor`;
PyTorch reference: `sub_block_reference.score_sub_blocks_reference`, same arguments):

* queries: [M, Hq, D] float32, bfloat16 or float16, CUDA, already in the
  index's query space (not rotated here).
* entries: the whole index buffer [num_slots, L, S, H, D], bfloat16, float16
  or float32, CUDA, with a unit last stride (the index buffer is contiguous).
  Only rows `entries[slots[b], layer]` are read, by indirect loads through the
  tensor's strides; no gathered copy is made.
* layer: int in [0, L); slots: [B] int64 CUDA, each in [0, num_slots);
  valid: [num_slots] bool CUDA.
* GQA: query head h reads KV head g = h // (Hq // H).
* Result [Hq, B] float32 on the same device:

      logit[m, h, b] = logsumexp_s(q[m, h] . entries[slots[b], layer, s, g] / sqrt(D))   (S == 1: the dot)
      out[h, b]      = sum_m softmax_b(logit[m, h, :], invalid candidates -> -inf)[b]

  where candidate b is invalid when `valid[slots[b]]` is False. Invalid
  candidates score exactly 0; a query with no valid candidate contributes 0
  (not NaN). B == 0 gives an empty [Hq, 0]; M == 0 gives zeros.
* Limits: D a power of two >= 16 and S a power of two (1, 2, 4, 8, 16); Hq a
  multiple of H. Anything else raises ValueError naming the argument, as do
  bad shapes, dtypes and devices. Slots outside [0, num_slots) are not
  checked (that would need a host sync); the kernel treats them as invalid
  (the reference raises).
* Arithmetic: `tl.dot` takes the entries' dtype, so float32 queries against
  16-bit entries are split into two 16-bit parts, `q = q_hi + q_lo`
  (`q_hi` the rounded queries, `q_lo` the rounded rest), and each dot is
  `q_hi . k + q_lo . k` (16-bit products, float32 accumulation): the queries
  then carry about 16 significant bits instead of 8, and the scores match the
  float32 reference to about 1e-5 relative, for twice the matrix work.
  16-bit queries are used as they are; float32 entries take IEEE float32 dots.
  Scaling, exponentials and sums run in float32.
* Never synchronizes with the host (no `.item()`, no data-dependent shape):
  everything is enqueued on the current CUDA stream; fit for vLLM's forward
  pass. Mutates nothing; allocates the result, O(splits * Hq * M) floats and,
  when the dtypes differ, a copy of the queries in the entries' dtype.
* Compiles on first use, about a second per variant: the row tiles shrink
  for small M (powers of two), nothing else varies with the sizes (the
  candidate tiles are fixed and the size arguments are not specialized), so
  `warm_up` compiles every variant a probe can meet, a handful, up front.

Design: two passes. The logsumexp over a block's S
vectors needs no pass of its own: exp(logit_b) = sum_s exp(dot_bs), so

    softmax_b(logit)[b] = sum_s exp2(dot_bs * log2e / sqrt(D) - LSE2),
    LSE2 = log2-sum-exp2 over all (valid b, s) of the scaled dots,

i.e. the S vectors of a block are scored like S independent Mean-K entries
and their probabilities summed per block.

Pass 1 (`_lse_kernel`, grid [row tiles, H, splits]): the rows of one KV head
g are (query head of the group j, query m), row = j * M + m. Each program
keeps a tile of rows resident and streams one split of the candidate list,
`BLOCK_V` entry vectors (`BLOCK_V // S` blocks) per step: slot indices and
validity are gathered, the entry vectors loaded through the slot (masked to 0
where invalid), dotted with the rows, masked to -inf where invalid, and
folded into an online max / sum. It stores the partial log2-sum-exp2 per row
and split; `_combine_kernel` merges the splits (skipped when there is one).
The candidate axis is split so that pass 1 fills the GPU: with H = 8 and
Hq * M = 2048 rows there are only 16 row tiles per layer.

Pass 2 (`_accum_kernel`, grid [block tiles, H]): each program keeps `BLOCK_V`
entry vectors of one KV head resident, streams the group's queries (L2
resident), recomputes the dots, p = exp2(dot - LSE2), accumulates them
elementwise over query tiles, reduces over rows once per query head, sums
each block's S vectors (a [BLOCK_V] -> [BLOCK_V // S, S] reshape) and writes
out[h, b] for its blocks: every output element is written exactly once.

Cost per layer: 2 passes x 2 * Hq * M * B * S * D FLOPs and one exp2 per
(row, vector) per pass. At B = 16384, S = 8, H = 8, D = 128, Hq = 32, M = 64
that is 137 GFLOP and 0.54 G exp2 per layer, against 268 MB of entries read:
compute-bound (matrix and special-function units), not memory-bound.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .sub_block_reference import check_sub_block_args

_LOG2E = 1.4426950408889634
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # CPU debugging via Triton's interpreter
_INTERPRET_SMS = 4  # stands in for the SM count under the interpreter (exercises splitting)
_MAX_S = 16


@dataclass(frozen=True)
class SubBlockConfig:
    """Tile shapes of the two passes (block sizes powers of two >= 16).

    `*_block_m`: query rows per tile (clamped down for small M); `*_block_v`:
    entry vectors per tile, i.e. `block_v // S` candidate blocks (raised to S
    when smaller; clamped down for small B). Pass 1 splits the candidates
    into about `lse_waves * SMs / (row tiles * H)` parts (at most
    `max_splits`); `lse_splits` > 0 forces that many (tests)."""

    lse_block_m: int = 128
    lse_block_v: int = 64
    lse_warps: int = 8
    lse_stages: int = 3
    acc_block_m: int = 64
    acc_block_v: int = 128
    acc_warps: int = 8
    acc_stages: int = 3
    lse_waves: int = 4
    max_splits: int = 64
    lse_splits: int = 0
    combine_block: int = 256

    def __post_init__(self) -> None:
        for name in ("lse_block_m", "lse_block_v", "acc_block_m", "acc_block_v", "combine_block"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        if self.lse_waves < 1 or self.max_splits < 1 or self.lse_splits < 0:
            raise ValueError("lse_waves and max_splits must be >= 1, lse_splits >= 0")


DEFAULT_CONFIG = SubBlockConfig()


@triton.jit
def _gather_vectors(E, SLOTS, VALID, first_block, end_block, num_slots, stride_eb, stride_es, g_off,
                    S: tl.constexpr, BLOCK_V: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Entry vectors i = n * S + s of blocks first_block + n (< end_block):
    [BLOCK_V, HEAD_DIM] (0 where invalid) and their validity [BLOCK_V]."""
    vv = tl.arange(0, BLOCK_V)
    blk = first_block + vv // S
    sub = vv % S
    ok = blk < end_block
    slot = tl.load(SLOTS + blk, mask=ok, other=0)
    ok = ok & (slot >= 0) & (slot < num_slots)
    ok = ok & (tl.load(VALID + slot, mask=ok, other=0) != 0)
    dd = tl.arange(0, HEAD_DIM)
    row = slot * stride_eb + sub * stride_es + g_off  # int64: slot is int64
    k = tl.load(E + row[:, None] + dd[None, :], mask=ok[:, None], other=0.0)
    return k, ok


@triton.jit
def _load_rows(Q, rows, row_mask, num_queries, group_base, stride_qm, stride_qh, stride_qd,
               HEAD_DIM: tl.constexpr):
    """Query rows j * M + m of one GQA group (query head group_base + j) -> [rows, HEAD_DIM]."""
    head = group_base + rows // num_queries
    tok = rows % num_queries
    dd = tl.arange(0, HEAD_DIM)
    ptr = Q + tok[:, None].to(tl.int64) * stride_qm + head[:, None].to(tl.int64) * stride_qh + dd[None, :] * stride_qd
    return tl.load(ptr, mask=row_mask[:, None], other=0.0)


def _unspecialized(*names: str):
    """`triton.jit` without specializing these integer arguments on their
    value (1, divisibility by 16): a new candidate or query count reuses the
    compiled kernel instead of compiling another."""
    return triton.jit(do_not_specialize=list(names))


@_unspecialized("num_cands", "num_slots", "num_queries", "group_rows", "blocks_per_split", "part_stride")
def _lse_kernel(
    Q, Q_LO, E, SLOTS, VALID, PART, num_cands, num_slots, num_queries, group_rows, blocks_per_split, part_stride,
    stride_qm, stride_qh, stride_qd, stride_eb, stride_es, stride_eh, qk_scale_log2,
    GROUP: tl.constexpr, S: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, SPLIT_Q: tl.constexpr,
):
    pid_m = tl.program_id(0)
    g = tl.program_id(1)
    split = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < group_rows
    q = _load_rows(Q, rows, row_mask, num_queries, g * GROUP, stride_qm, stride_qh, stride_qd, HEAD_DIM)
    if SPLIT_Q:
        q_lo = _load_rows(Q_LO, rows, row_mask, num_queries, g * GROUP, stride_qm, stride_qh, stride_qd, HEAD_DIM)
    g_off = g.to(tl.int64) * stride_eh
    start = split * blocks_per_split
    end = tl.minimum(num_cands, start + blocks_per_split)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    s_i = tl.zeros([BLOCK_M], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        k, ok = _gather_vectors(E, SLOTS, VALID, n0, end, num_slots, stride_eb, stride_es, g_off,
                                S, BLOCK_V, HEAD_DIM)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        if SPLIT_Q:
            qk = tl.dot(q_lo, tl.trans(k), acc=qk, input_precision=DOT_PREC)
        qk = qk * qk_scale_log2
        qk = tl.where(ok[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing valid yet: no -inf - -inf
        s_i = s_i * tl.exp2(m_i - m_use) + tl.sum(tl.exp2(qk - m_use[:, None]), 1)
        m_i = m_new
    lse = m_i + tl.log2(s_i)  # -inf where no valid vector
    tl.store(PART + split * part_stride + g * group_rows + rows, lse, mask=row_mask)


@_unspecialized("n", "num_splits", "part_stride")
def _combine_kernel(PART, LSE, n, num_splits, part_stride, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    sp = tl.arange(0, SPLITS)
    x = tl.load(PART + sp[:, None] * part_stride + offs[None, :],
                mask=(sp[:, None] < num_splits) & mask[None, :], other=float("-inf"))
    mx = tl.max(x, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    tl.store(LSE + offs, mx + tl.log2(tl.sum(tl.exp2(x - mx[None, :]), 0)), mask=mask)


@_unspecialized("num_cands", "num_slots", "num_queries", "group_rows", "stride_oh")
def _accum_kernel(
    Q, Q_LO, E, SLOTS, VALID, LSE, OUT, num_cands, num_slots, num_queries, group_rows, stride_oh,
    stride_qm, stride_qh, stride_qd, stride_eb, stride_es, stride_eh, qk_scale_log2,
    GROUP: tl.constexpr, S: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, SPLIT_Q: tl.constexpr,
):
    pid_n = tl.program_id(0)
    g = tl.program_id(1)
    first = pid_n * BLOCK_N
    k, ok = _gather_vectors(E, SLOTS, VALID, first, num_cands, num_slots, stride_eb, stride_es,
                            g.to(tl.int64) * stride_eh, S, BLOCK_V, HEAD_DIM)
    kt = tl.trans(k)
    lse_base = LSE + g * group_rows
    blocks = first + tl.arange(0, BLOCK_N)
    for j in range(0, GROUP):
        # Elementwise accumulation over query tiles; one reduction over rows per head.
        acc2 = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
        for t0 in range(0, num_queries, BLOCK_M):
            toks = t0 + tl.arange(0, BLOCK_M)
            t_mask = toks < num_queries
            rows = j * num_queries + toks
            q = _load_rows(Q, rows, t_mask, num_queries, g * GROUP, stride_qm, stride_qh, stride_qd, HEAD_DIM)
            lse = tl.load(lse_base + rows, mask=t_mask, other=float("inf"))  # padded rows: p = 0
            qk = tl.dot(q, kt, input_precision=DOT_PREC)
            if SPLIT_Q:
                q_lo = _load_rows(Q_LO, rows, t_mask, num_queries, g * GROUP, stride_qm, stride_qh, stride_qd,
                                  HEAD_DIM)
                qk = tl.dot(q_lo, kt, acc=qk, input_precision=DOT_PREC)
            acc2 += tl.exp2(qk * qk_scale_log2 - lse[:, None])
        # Invalid vectors (k = 0, so qk = 0) may hold garbage (even inf when no
        # candidate is valid and LSE2 = -inf): confined to their own column, dropped here.
        acc = tl.where(ok, tl.sum(acc2, 0), 0.0)
        if S > 1:
            acc = tl.sum(tl.reshape(acc, [BLOCK_N, S]), 1)
        tl.store(OUT + (g * GROUP + j) * stride_oh + blocks, acc, mask=blocks < num_cands)


def _sm_count(device: torch.device) -> int:
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count_of(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count  # host query, no sync


def _row_tile(cap: int, rows: int) -> int:
    """Rows per tile: the rows rounded up to a power of two, 16 to `cap`."""
    return min(cap, max(16, triton.next_power_of_2(max(int(rows), 1))))


def warm_up(entries: torch.Tensor, q_heads: int, config: SubBlockConfig | None = None) -> int:
    """Compile every kernel variant `score_sub_blocks` can meet on `entries`
    with `q_heads` query heads (one per pair of row tiles, and the splits'
    combine), by scoring zero queries against no valid candidate. Returns the
    number of query counts scored. Blocks until done (start-up, not a step)."""
    cfg = config or DEFAULT_CONFIG
    num_slots, _, _, kv_heads, head_dim = entries.shape
    group = q_heads // kv_heads
    seen: dict[tuple[int, int], int] = {}
    for m in range(1, max(cfg.acc_block_m, triton.cdiv(cfg.lse_block_m, group)) + 1):
        seen.setdefault((_row_tile(cfg.lse_block_m, group * m), _row_tile(cfg.acc_block_m, m)), m)
    slots = torch.arange(num_slots, dtype=torch.int64, device=entries.device)
    valid = torch.zeros(num_slots, dtype=torch.bool, device=entries.device)
    for m in seen.values():
        queries = torch.zeros((m, q_heads, head_dim), dtype=torch.float32, device=entries.device)
        score_sub_blocks(queries, entries, 0, slots, valid, cfg)
    torch.cuda.synchronize(entries.device)
    return len(seen)


def score_sub_blocks(
    queries: torch.Tensor,
    entries: torch.Tensor,
    layer: int,
    slots: torch.Tensor,
    valid: torch.Tensor,
    config: SubBlockConfig | None = None,
) -> torch.Tensor:
    """Triton version of `sub_block_reference.score_sub_blocks_reference`; see the module
    docstring for the contract. `config` picks tile shapes (tests, benchmarks).
    Returns [Hq, B] float32 without synchronizing with the host."""
    check_sub_block_args(queries, entries, layer, slots, valid)
    num_slots, _, s, kv_heads, head_dim = entries.shape
    num_queries, q_heads, _ = queries.shape
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"entries: head_dim must be a power of two >= 16, got {head_dim}")
    if s > _MAX_S or s & (s - 1):
        raise ValueError(f"entries: S (vectors per block) must be a power of two <= {_MAX_S}, got {s}")
    if entries.stride(4) != 1:
        raise ValueError("entries: the last dim must be contiguous (stride 1)")
    if not _INTERPRET and not queries.is_cuda:
        raise ValueError("queries: the Triton sub-block kernel needs CUDA tensors; use the reference elsewhere")
    cfg = config or DEFAULT_CONFIG
    num_cands = slots.shape[0]
    if num_cands == 0 or num_queries == 0:
        return torch.zeros(q_heads, num_cands, dtype=torch.float32, device=queries.device)
    out = torch.empty(q_heads, num_cands, dtype=torch.float32, device=queries.device)
    group = q_heads // kv_heads
    group_rows = group * num_queries
    q = queries.to(entries.dtype)  # a copy only when the dtypes differ
    split_q = queries.dtype == torch.float32 and entries.dtype != torch.float32
    # q_lo: what rounding to 16 bits lost (same strides as q: both fresh or both `queries`)
    q_lo = (queries - q.float()).to(entries.dtype) if split_q else q
    if split_q and q_lo.stride() != q.stride():
        q, q_lo = q.contiguous(), q_lo.contiguous()
    e = entries.select(1, layer)  # [num_slots, S, H, D] view: its data pointer sits at the layer
    slots = slots.contiguous()  # both are indexed with unit stride (no copy when already contiguous)
    valid_u8 = valid.contiguous().view(torch.uint8)
    prec = "ieee" if entries.dtype == torch.float32 else "tf32"  # ignored for 16-bit inputs
    scale = _LOG2E / math.sqrt(head_dim)
    strides = (q.stride(0), q.stride(1), q.stride(2), e.stride(0), e.stride(1), e.stride(2))

    # Pass 1: partial log2-sum-exp2 per (split, KV head, row).
    bm1 = _row_tile(cfg.lse_block_m, group_rows)
    bv1 = max(s, cfg.lse_block_v)
    bn1 = bv1 // s
    row_tiles = triton.cdiv(group_rows, bm1)
    if cfg.lse_splits:
        want = cfg.lse_splits
    else:
        sms = _sm_count(queries.device) if queries.is_cuda else _INTERPRET_SMS
        want = max(1, cfg.lse_waves * sms // (row_tiles * kv_heads))
    want = max(1, min(want, cfg.max_splits, triton.cdiv(num_cands, bn1)))
    blocks_per_split = triton.cdiv(triton.cdiv(num_cands, want), bn1) * bn1
    splits = triton.cdiv(num_cands, blocks_per_split)  # none empty
    part_stride = kv_heads * group_rows
    part = torch.empty(splits * part_stride, dtype=torch.float32, device=queries.device)
    _lse_kernel[(row_tiles, kv_heads, splits)](
        q, q_lo, e, slots, valid_u8, part, num_cands, num_slots, num_queries, group_rows, blocks_per_split, part_stride,
        *strides, scale,
        GROUP=group, S=s, HEAD_DIM=head_dim, BLOCK_M=bm1, BLOCK_V=bv1, BLOCK_N=bn1, DOT_PREC=prec, SPLIT_Q=split_q,
        num_warps=cfg.lse_warps, num_stages=cfg.lse_stages,
    )
    if splits == 1:
        lse = part
    else:
        lse = torch.empty(part_stride, dtype=torch.float32, device=queries.device)
        _combine_kernel[(triton.cdiv(part_stride, cfg.combine_block),)](
            part, lse, part_stride, splits, part_stride,
            SPLITS=triton.next_power_of_2(cfg.max_splits), BLOCK=cfg.combine_block, num_warps=4,
        )

    # Pass 2: probabilities summed over queries and each block's S vectors.
    bm2 = _row_tile(cfg.acc_block_m, num_queries)
    bv2 = max(s, cfg.acc_block_v)
    _accum_kernel[(triton.cdiv(num_cands, bv2 // s), kv_heads)](  # writes every out[h, b] once
        q, q_lo, e, slots, valid_u8, lse, out, num_cands, num_slots, num_queries, group_rows, out.stride(0),
        *strides, scale,
        GROUP=group, S=s, HEAD_DIM=head_dim, BLOCK_M=bm2, BLOCK_V=bv2, BLOCK_N=bv2 // s, DOT_PREC=prec,
        SPLIT_Q=split_q,
        num_warps=cfg.acc_warps, num_stages=cfg.acc_stages,
    )
    return out
