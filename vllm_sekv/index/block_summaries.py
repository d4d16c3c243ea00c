"""Block summaries for the workspace's block index, and how queries score them.

Pure torch, no vLLM imports. A *summary kind* says how the keys of one block
(``block_tokens`` consecutive tokens, normally 32) become ``S`` small vectors per
KV head, and how a query scores such a block. The index stores, per layer,
``[num_blocks, S, kv_heads, head_dim]``; a probe scores it with the new tokens'
queries and reduces the result to one relevance ``R_b`` per block.

Canonical shapes (``T`` tokens, ``H`` KV heads, ``Hq`` query heads, ``D`` head_dim):

* keys: ``[..., T, H, D]``, pre-RoPE and post-RoPE (post-RoPE = rotated at the
  token's *virtual* position, i.e. its position in the full history);
* weights: ``[..., T]`` or ``None``; per-token weights that sum to 1 within a
  block (see :func:`surprisal_weights`); kinds that do not use them ignore them;
* summary: ``[..., S, H, D]``;
* queries: ``[..., Hq, D]``; GQA maps query head ``h`` to KV head
  ``h // (Hq // H)`` (HF ``repeat_kv`` order).

Each kind scores with the queries of its ``query_space``: ``"pre"`` (pre-RoPE,
position-free: works at any distance, also beyond the model's window) or
``"post"`` (post-RoPE at the query's virtual position: exact relative-position
scoring while the history is within the window).

Relevance (:func:`score`): per layer ``l``, query head ``h`` and new token ``m``,
``p = softmax_b(logit(q, block_b))``, summed over ``m`` -> ``[L, Hq, B]``, then
combined over (layer, head): ``"mean"`` (KVMEM), ``"max"`` (keeps the few
retrieval heads that a mean drowns) or ``"top<m>"`` (mean of the m largest).
All functions are pure and blocking: they never modify their inputs, allocate
their outputs, and raise ``ValueError`` on bad shapes or names.

The default (``DEFAULT_SUMMARY`` / ``DEFAULT_COMBINE`` = ``"anchor_pre"`` /
``"top8"``) and the in-window companion (``POSITION_SUMMARY`` /
``POSITION_COMBINE`` = ``"minmax_post"`` / ``"mean"``) were chosen by
``benchmarks/index_study`` (results in ``benchmarks/results/index_study/report.md``).
Typical use, per step::

    idx = summarize_blocks(DEFAULT_SUMMARY, k_pre, k_post, surprisal_weights(h))  # per layer
    r = score(DEFAULT_SUMMARY, q_pre, idx_all_layers, DEFAULT_COMBINE)            # [B]
    keep = select_blocks(r, k, forced=sink_and_recent)  # or [r_position, r] to interleave
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

__all__ = [
    "SummaryKind", "SUMMARY_KINDS", "DEFAULT_SUMMARY", "DEFAULT_COMBINE", "COMBINES",
    "POSITION_SUMMARY", "POSITION_COMBINE",
    "get_kind", "summarize_blocks", "block_logits", "score_per_head", "combine_heads",
    "score", "select_blocks", "surprisal_weights",
]

COMBINES = ("mean", "max", "top<m>")   # top<m>: mean of the m largest (layer, head) scores


@dataclass(frozen=True)
class SummaryKind:
    """One named way to summarize a block and score it.

    ``summarize(keys_pre [..., T, H, D], keys_post [..., T, H, D], weights [..., T] | None)
    -> [..., S, H, D]`` summarizes one block (``T`` = its tokens; leading dims batch
    blocks). ``logits(queries [..., Hq, D], summaries [B, S, H, D]) -> [..., Hq, B]``
    is the (already ``1/sqrt(D)``-scaled) log-relevance of each block for each query.
    """

    name: str
    query_space: str          # "pre" or "post": which queries score this kind
    vectors_per_block: int    # S
    uses_weights: bool        # True: summarize needs per-token weights
    summarize: Callable[[Tensor, Tensor, Optional[Tensor]], Tensor]
    logits: Callable[[Tensor, Tensor], Tensor]
    doc: str = ""

    @property
    def logsumexp_logits(self) -> bool:
        """Whether a block's logit is the logsumexp of its S vectors' dots (or
        the dot when S == 1): what the fused scoring kernel computes."""
        return self.logits is _lse_logits


# ---------------------------------------------------------------- summarize


def _mean(keys: Tensor, weights: Optional[Tensor]) -> Tensor:
    """[..., T, H, D] -> [..., 1, H, D]; weighted mean when weights [..., T] are given."""
    if weights is None:
        return keys.mean(dim=-3, keepdim=True)
    w = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-12)
    return torch.einsum("...t,...thd->...hd", w.to(keys.dtype), keys).unsqueeze(-3)


def _sub_means(keys: Tensor, weights: Optional[Tensor], parts: int) -> Tensor:
    """[..., T, H, D] -> [..., parts, H, D]: mean of each of ``parts`` equal sub-blocks."""
    t = keys.shape[-3]
    if t % parts:
        raise ValueError(f"block of {t} tokens does not split into {parts} sub-blocks")
    k = keys.reshape(*keys.shape[:-3], parts, t // parts, *keys.shape[-2:])
    w = None if weights is None else weights.reshape(*weights.shape[:-1], parts, t // parts)
    return _mean(k, w).squeeze(-3)


def _minmax(keys: Tensor) -> Tensor:
    """[..., T, H, D] -> [..., 2, H, D]: per-dimension min (index 0) and max (index 1)."""
    return torch.stack([keys.amin(dim=-3), keys.amax(dim=-3)], dim=-3)


def _anchor_mean(keys: Tensor, weights: Optional[Tensor]) -> Tensor:
    """[..., T, H, D] -> [..., 2, H, D]: block mean plus the key of the heaviest token.

    The heaviest token (largest weight, e.g. highest surprisal) is the block's
    anchor; without weights the first token is used.
    """
    mean = _mean(keys, None)
    if weights is None:
        idx = torch.zeros(keys.shape[:-3], dtype=torch.long, device=keys.device)
    else:
        idx = weights.argmax(dim=-1)
    gather = idx[..., None, None, None].expand(*keys.shape[:-3], 1, *keys.shape[-2:])
    return torch.cat([mean, torch.gather(keys, -3, gather)], dim=-3)


def _outlier_mean(keys: Tensor) -> Tensor:
    """[..., T, H, D] -> [..., 2, H, D]: block mean plus, per head, the key farthest
    (L2) from that mean: an anchor that needs no surprisal, only the keys."""
    mean = keys.mean(dim=-3, keepdim=True)
    idx = (keys - mean).square().sum(-1).argmax(dim=-2)              # [..., H]
    gather = idx[..., None, :, None].expand(*keys.shape[:-3], 1, *keys.shape[-2:])
    return torch.cat([mean, torch.gather(keys, -3, gather)], dim=-3)


def _sub_means_anchor(keys: Tensor, weights: Optional[Tensor], parts: int) -> Tensor:
    """[..., T, H, D] -> [..., parts + 1, H, D]: sub-block means plus the anchor token's key."""
    return torch.cat([_sub_means(keys, None, parts), _anchor_mean(keys, weights)[..., 1:, :, :]], dim=-3)


# ---------------------------------------------------------------- logits


def _gqa_dot(queries: Tensor, summaries: Tensor) -> Tensor:
    """queries [..., Hq, D], summaries [B, S, H, D] -> [H, M, Hq/H, B, S] of
    q.k / sqrt(D), M the queries' leading dims flattened: one batched matmul
    per KV head over the summaries' own memory (the (B, S) rows of head g are
    a strided view), its output in the layout the matmul writes. Reduce over
    S before `_per_query_head`, which is the only copy of the result."""
    hq, d = queries.shape[-2:]
    b, s, h, d2 = summaries.shape
    if d != d2 or hq % h:
        raise ValueError(f"queries [..., {hq}, {d}] do not fit summaries [{b}, {s}, {h}, {d2}]")
    q = queries.reshape(-1, h, hq // h, d)
    m = q.shape[0]
    q = (q / math.sqrt(d)).permute(1, 0, 2, 3).reshape(h, m * (hq // h), d)
    keys = summaries.to(queries.dtype).reshape(b * s, h, d).permute(1, 2, 0)  # [H, D, B*S], a view
    return torch.matmul(q, keys).view(h, m, hq // h, b, s)


def _per_query_head(grouped: Tensor, queries: Tensor) -> Tensor:
    """[H, M, Hq/H, B] (from `_gqa_dot`, reduced over S) -> [..., Hq, B] in the queries' leading dims."""
    h, m, r, b = grouped.shape
    return grouped.permute(1, 0, 2, 3).reshape(*queries.shape[:-2], h * r, b)


def _lse_logits(queries: Tensor, summaries: Tensor) -> Tensor:
    """Block log-relevance = logsumexp over the block's S vectors (S=1: the plain dot)."""
    dots = _gqa_dot(queries, summaries)
    reduced = dots[..., 0] if dots.shape[-1] == 1 else torch.logsumexp(dots, dim=-1)
    return _per_query_head(reduced, queries)


def _minmax_logits(queries: Tensor, summaries: Tensor) -> Tensor:
    """Quest bound: sum_d max(q_d * min_d, q_d * max_d) / sqrt(D) >= max_t q.k_t / sqrt(D)."""
    hq, d = queries.shape[-2:]
    b, s, h, _ = summaries.shape
    if s != 2:
        raise ValueError("minmax summaries need S == 2 (min, max)")
    q = queries.reshape(*queries.shape[:-2], h, hq // h, d)            # [..., g, r, d]
    lo = torch.einsum("...grd,bgd->...grbd", q, summaries[:, 0].to(q.dtype))
    hi = torch.einsum("...grd,bgd->...grbd", q, summaries[:, 1].to(q.dtype))
    bound = torch.maximum(lo, hi).sum(dim=-1)
    return bound.reshape(*queries.shape[:-2], hq, b) / math.sqrt(d)


# ---------------------------------------------------------------- registry


def _kind(name, space, s, uses_w, fn, logits=_lse_logits, doc=""):
    return SummaryKind(name, space, s, uses_w, fn, logits, doc)


def _pick(space: str):
    return (lambda kp, kq: kp) if space == "pre" else (lambda kp, kq: kq)


SUMMARY_KINDS: dict[str, SummaryKind] = {}
for _space in ("pre", "post"):
    _k = _pick(_space)
    for _kd in (
        _kind(f"mean_{_space}", _space, 1, False, lambda kp, kq, w, _k=_k: _mean(_k(kp, kq), None),
              doc="mean key of the block (pre: KVMEM Mean-K; post: ShadowKV-like)"),
        _kind(f"wmean_{_space}", _space, 1, True, lambda kp, kq, w, _k=_k: _mean(_k(kp, kq), w),
              doc="weighted mean key, weights w_t = H_t / sum H (SeKV surprisal weighting)"),
        _kind(f"sub16_{_space}", _space, 2, False,
              lambda kp, kq, w, _k=_k: _sub_means(_k(kp, kq), None, 2),
              doc="two vectors: means of the two 16-token halves; block logit = logsumexp"),
        _kind(f"sub8_{_space}", _space, 4, False,
              lambda kp, kq, w, _k=_k: _sub_means(_k(kp, kq), None, 4),
              doc="four vectors: means of the four 8-token quarters; block logit = logsumexp"),
        _kind(f"sub4_{_space}", _space, 8, False,
              lambda kp, kq, w, _k=_k: _sub_means(_k(kp, kq), None, 8),
              doc="eight vectors: means of the eight 4-token sub-blocks; block logit = logsumexp"),
        _kind(f"outlier_{_space}", _space, 2, False,
              lambda kp, kq, w, _k=_k: _outlier_mean(_k(kp, kq)),
              doc="block mean + per head the key farthest from it (anchor without surprisal)"),
        _kind(f"sub8a_{_space}", _space, 5, True,
              lambda kp, kq, w, _k=_k: _sub_means_anchor(_k(kp, kq), w, 4),
              doc="four 8-token sub-block means + the highest-surprisal (anchor) token's key"),
        _kind(f"wsub8_{_space}", _space, 4, True,
              lambda kp, kq, w, _k=_k: _sub_means(_k(kp, kq), w, 4),
              doc="four surprisal-weighted 8-token sub-block means"),
        _kind(f"anchor_{_space}", _space, 2, True,
              lambda kp, kq, w, _k=_k: _anchor_mean(_k(kp, kq), w),
              doc="block mean + key of the highest-surprisal (anchor) token"),
        _kind(f"minmax_{_space}", _space, 2, False,
              lambda kp, kq, w, _k=_k: _minmax(_k(kp, kq)), _minmax_logits,
              doc="per-dimension min/max (Quest upper bound)"),
    ):
        SUMMARY_KINDS[_kd.name] = _kd

# Chosen by benchmarks/index_study (see benchmarks/results/index_study/report.md): best
# retrieval of a distant fact among the summaries measured on every trial, two
# vectors per block (2x Mean-K), position-free (works beyond the model's window).
# Needs per-token surprisal for the anchor. Within the window, pair it with a
# position-aware ranking (POSITION_SUMMARY / POSITION_COMBINE) via select_blocks.
DEFAULT_SUMMARY = "anchor_pre"
DEFAULT_COMBINE = "top8"
POSITION_SUMMARY = "minmax_post"
POSITION_COMBINE = "mean"


def get_kind(kind: "str | SummaryKind") -> SummaryKind:
    """Look a kind up by name (or pass a :class:`SummaryKind` through)."""
    if isinstance(kind, SummaryKind):
        return kind
    try:
        return SUMMARY_KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown summary kind {kind!r}; known: {sorted(SUMMARY_KINDS)}") from None


# ---------------------------------------------------------------- public API


def surprisal_weights(surprisal: Tensor, block_tokens: int = 32) -> Tensor:
    """Per-token surprisal [T] (T a multiple of ``block_tokens``) -> weights [T]
    with ``w_t = H_t / sum_{t in block} H_t`` (uniform in a block whose sum is 0).
    Negative or non-finite surprisals are treated as 0."""
    if surprisal.dim() != 1 or surprisal.shape[0] % block_tokens:
        raise ValueError(f"surprisal must be [T] with T a multiple of {block_tokens}")
    h = torch.nan_to_num(surprisal.float(), nan=0.0, posinf=0.0).clamp_min(0.0)
    h = h.reshape(-1, block_tokens)
    s = h.sum(dim=-1, keepdim=True)
    w = torch.where(s > 0, h / s.clamp_min(1e-12), torch.full_like(h, 1.0 / block_tokens))
    return w.reshape(-1)


def summarize_blocks(kind, keys_pre: Tensor, keys_post: Tensor,
                     weights: Optional[Tensor] = None, block_tokens: int = 32) -> Tensor:
    """Summarize consecutive blocks: keys [T, H, D] (T = B * block_tokens) -> [B, S, H, D].

    ``weights`` [T] is required by kinds with ``uses_weights`` (except ``anchor_*`` and
    ``sub8a_*``, whose anchor falls back to the first token) and ignored by the others.
    """
    k = get_kind(kind)
    if keys_pre.shape != keys_post.shape or keys_pre.dim() != 3:
        raise ValueError("keys_pre and keys_post must both be [T, H, D]")
    t, h, d = keys_pre.shape
    if t % block_tokens:
        raise ValueError(f"{t} tokens is not a multiple of block_tokens={block_tokens}")
    if k.uses_weights and weights is None and not k.name.startswith(("anchor", "sub8a")):
        raise ValueError(f"summary kind {k.name!r} needs per-token weights")
    b = t // block_tokens
    w = None if weights is None else weights.reshape(b, block_tokens)
    out = k.summarize(keys_pre.reshape(b, block_tokens, h, d),
                      keys_post.reshape(b, block_tokens, h, d), w)
    return out


def block_logits(kind, queries: Tensor, summaries: Tensor) -> Tensor:
    """queries [..., Hq, D] (in ``kind.query_space``), summaries [B, S, H, D] -> [..., Hq, B]."""
    return get_kind(kind).logits(queries, summaries)


def score_per_head(kind, queries: Tensor, summaries: Tensor) -> Tensor:
    """Per-head relevance ``sum_m softmax_b(logit)``.

    queries [L, M, Hq, D] and summaries [L, B, S, H, D] (or [M, Hq, D] and
    [B, S, H, D] for one layer) -> [L, Hq, B] (or [Hq, B]). Layers are
    processed one at a time to bound memory.
    """
    single = queries.dim() == 3
    if single:
        queries, summaries = queries[None], summaries[None]
    if queries.dim() != 4 or summaries.dim() != 5 or queries.shape[0] != summaries.shape[0]:
        raise ValueError("queries must be [L, M, Hq, D] and summaries [L, B, S, H, D]")
    out = torch.stack([
        torch.softmax(block_logits(kind, queries[l].float(), summaries[l].float()), dim=-1).sum(0)
        for l in range(queries.shape[0])
    ])
    return out[0] if single else out


def combine_heads(per_head: Tensor, combine: str = DEFAULT_COMBINE) -> Tensor:
    """[..., B] per (layer, head) scores -> [B], over all leading dims: ``"mean"``,
    ``"max"``, or ``"top<m>"`` (e.g. ``"top8"``): per block, the mean of its m largest
    (layer, head) scores (m=1 is max; m=all is mean)."""
    flat = per_head.reshape(-1, per_head.shape[-1])
    if combine == "mean":
        return flat.mean(0)
    if combine == "max":
        return flat.amax(0)
    if combine.startswith("top") and combine[3:].isdigit() and int(combine[3:]) >= 1:
        m = min(int(combine[3:]), flat.shape[0])
        return flat.topk(m, dim=0).values.mean(0)
    raise ValueError(f"combine must be 'mean', 'max' or 'top<m>' (m >= 1), got {combine!r}")


def score(kind, queries: Tensor, summaries: Tensor, combine: str = DEFAULT_COMBINE) -> Tensor:
    """Relevance [B] of each block: :func:`score_per_head` then :func:`combine_heads`.

    With tensor parallelism each rank holds some KV heads: "max" partial results
    combine by max, "mean" by a head-count-weighted sum, "top<m>" by sending each
    rank's m largest per block and taking the m largest of those.
    """
    return combine_heads(score_per_head(kind, queries, summaries), combine)


def select_blocks(relevance, k: int, forced=()) -> Tensor:
    """Indices (ascending) of ``forced`` blocks plus ``k`` more chosen by relevance.

    relevance: [B], or a sequence of [B] tensors (e.g. a position-aware and a
    content relevance), whose rankings are interleaved: each gets about
    ``k / n`` of the budget, and a block already taken is skipped. forced:
    block indices (sink, recent, anchors) always kept, not counted in ``k``.
    Ties break toward the lower index.
    """
    rels = [relevance] if isinstance(relevance, Tensor) else list(relevance)
    b = rels[0].shape[-1]
    if any(r.shape != (b,) for r in rels):
        raise ValueError("every relevance must be [B] with the same B")
    forced_set = set(int(i) for i in forced)
    if any(i < 0 or i >= b for i in forced_set):
        raise ValueError("forced block index out of range")
    orders = []
    for r in rels:
        r = r.detach().float().clone()
        r[sorted(forced_set)] = float("-inf")
        orders.append(torch.argsort(r, descending=True, stable=True).tolist())
    n = max(0, min(k, b - len(forced_set)))
    chosen: list[int] = []
    taken = set(forced_set)
    pos = [0] * len(orders)
    while len(chosen) < n:
        for j, order in enumerate(orders):
            while pos[j] < b and order[pos[j]] in taken:
                pos[j] += 1
            if pos[j] < b and len(chosen) < n:
                chosen.append(order[pos[j]])
                taken.add(order[pos[j]])
    return torch.tensor(sorted(forced_set | set(chosen)), dtype=torch.long)
