"""Surprisal segmentation: where SeKV cuts a session's tokens into segments.

Pure numpy/torch, no vLLM. Input is the per-token surprisal
``H_t = -log p(x_t | x_<t)`` (nats) of one session, token index ``t`` counted
from the session's first token.

Definitions (the contract every function here implements):

* **Sanitizing.** Negative and non-finite surprisals count as 0, as in
  :func:`vllm_sekv.index.block_summaries.surprisal_weights`.
* **Token 0** has no prediction. It is an anchor by definition, and its value
  (callers pass 0, NaN, anything) is ignored: it does not enter the statistics.
* **Anchor.** Token ``t >= 1`` is an anchor iff ``H_t > mu_t + alpha * sigma_t``,
  where ``mu_t`` and ``sigma_t`` are the mean and *population* standard deviation
  of ``H_1 .. H_t`` (inclusive of ``t``, token 0 excluded). Strict ``>``: a
  constant stretch has no anchors. Because ``t`` is inside its own statistics,
  the n-th predicted token is at most ``sqrt(n - 1)`` standard deviations above
  the mean, so with ``alpha = 2`` no anchor can occur among tokens 1..5; the
  first tokens of a session are rarely worth one anyway (token 0 is one).
* **Segments.** Every anchor starts a segment and *belongs to it* (it is the
  segment's first token); the segment runs up to the next segment start. With
  ``max_segment_tokens = m`` a segment that reaches ``m`` tokens is cut: tokens
  ``a + m, a + 2m, ...`` after the last anchor ``a`` also start segments (a
  *cut*, not an anchor), so a long low-surprisal stretch still splits.
  Anchors are kept at full resolution in every view, so segment summaries
  (``segment_summaries.py``) leave a segment's anchor out by default.

Statistics are running sums of ``H - K`` and ``(H - K)^2`` with a fixed shift
``K`` (the first predicted token's value; the "shifted data" variance, as
stable as Welford's update for surprisal-sized numbers) in float64, accumulated
with ``numpy.add.accumulate`` seeded by the carried state. Accumulation is
strictly sequential, so the state after any token, and hence every decision, is
bit-identical however the tokens are split into chunks (prefill chunks, decode
steps): :class:`SurprisalSegmenter` and :func:`segment` always agree.

Segments are ``int64`` CPU tensors (half-open ``[start, end)`` token ranges).
Blocks are fixed ``block_tokens`` spans of the workspace; a view is a token
sequence, so segments and anchors can be placed anywhere in it, and the block
helpers here are bookkeeping only.

All functions are pure and blocking; :meth:`SurprisalSegmenter.push` mutates
only its segmenter (not thread-safe). Bad arguments raise ``ValueError`` naming
the argument.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "DEFAULT_ALPHA", "DEFAULT_MAX_SEGMENT_TOKENS", "Segments", "SurprisalSegmenter",
    "segment", "check_alpha", "clean_surprisal", "segment_block_ranges",
    "block_segment_ranges", "block_anchor_mask",
]

# alpha = 2: a token more than two running standard deviations above the running
# mean. Measured on 6K tokens of essay text with SmolLM2-135M (surprisal mean 3.2,
# std 2.9 nats): alpha = 2 marks 5.2% of tokens as anchors, mean segment 19
# tokens (median 13, longest 138); alpha = 1.5: 9.4%, mean 11; alpha = 3: 1.1%,
# mean 93, longest 418. At 2, anchors stay cheap to keep at full resolution and
# a segment is on average shorter than a 32-token workspace block, so a segment
# summary is no coarser than a Mean-K block; the anchors are rare words, names
# and digits, the tokens a fact is made of (benchmarks/results/index_study/report.md).
# alpha = 3 would make summaries three times coarser than blocks.
DEFAULT_ALPHA = 2.0
# The cap: 256 tokens (8 blocks) never bound at alpha = 2 in that measurement; it
# only keeps a long predictable stretch (boilerplate, repeated text) from
# collapsing into one vector.
DEFAULT_MAX_SEGMENT_TOKENS = 256

ArrayLike = Union[Tensor, np.ndarray, Sequence[float]]


def check_alpha(alpha: float) -> float:
    """Return ``alpha`` as a float; ValueError unless it is a finite number >= 0."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.floating, np.integer)):
        raise ValueError(f"alpha must be a finite number >= 0, got {alpha!r}")
    alpha = float(alpha)
    if not math.isfinite(alpha) or alpha < 0:
        raise ValueError(f"alpha must be a finite number >= 0, got {alpha!r}")
    return alpha


def _check_max_segment_tokens(max_segment_tokens: Optional[int]) -> Optional[int]:
    if max_segment_tokens is None:
        return None
    if isinstance(max_segment_tokens, bool) or not isinstance(max_segment_tokens, (int, np.integer)) \
            or max_segment_tokens < 1:
        raise ValueError(f"max_segment_tokens must be None or an int >= 1, got {max_segment_tokens!r}")
    return int(max_segment_tokens)


def _check_block_tokens(block_tokens: int) -> int:
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, (int, np.integer)) or block_tokens < 1:
        raise ValueError(f"block_tokens must be an int >= 1, got {block_tokens!r}")
    return int(block_tokens)


def clean_surprisal(surprisal: ArrayLike) -> np.ndarray:
    """Surprisal [T] (tensor, array or sequence) -> float64 numpy [T] with negative
    and non-finite values set to 0. ValueError unless 1-D."""
    if isinstance(surprisal, Tensor):
        h = surprisal.detach().to("cpu", torch.float64).numpy()
    else:
        h = np.asarray(surprisal, dtype=np.float64)
    if h.ndim != 1:
        raise ValueError(f"surprisal must be 1-D [T], got shape {tuple(h.shape)}")
    h = np.where(np.isfinite(h), h, 0.0)
    return np.maximum(h, 0.0)


def _as_int64(x: ArrayLike) -> Tensor:
    if isinstance(x, Tensor):
        return x.detach().to("cpu", torch.int64)
    return torch.as_tensor(np.asarray(x, dtype=np.int64))


@dataclass(frozen=True)
class Segments:
    """Sorted, non-overlapping, non-empty token ranges ``[starts[s], ends[s])``.

    starts, ends: [S] int64 (CPU); is_anchor: [S] bool, True when the segment's
    first token is an anchor (False: a ``max_segment_tokens`` cut). Segments from
    :func:`segment` tile ``[0, num_tokens)``; a subset (:meth:`take`) may leave gaps.
    """

    starts: Tensor
    ends: Tensor
    is_anchor: Tensor

    def __post_init__(self) -> None:
        starts, ends = _as_int64(self.starts), _as_int64(self.ends)
        is_anchor = torch.as_tensor(self.is_anchor).detach().to("cpu", torch.bool)
        if starts.dim() != 1 or ends.shape != starts.shape or is_anchor.shape != starts.shape:
            raise ValueError("starts, ends and is_anchor must be 1-D of one length")
        if starts.numel():
            if int(starts[0]) < 0:
                raise ValueError("starts must be >= 0")
            if bool((ends <= starts).any()):
                raise ValueError("segments must be non-empty (ends > starts)")
            if bool((starts[1:] < ends[:-1]).any()):
                raise ValueError("segments must be sorted and non-overlapping")
        object.__setattr__(self, "starts", starts)
        object.__setattr__(self, "ends", ends)
        object.__setattr__(self, "is_anchor", is_anchor)

    @property
    def num_segments(self) -> int:
        return int(self.starts.numel())

    @property
    def num_tokens(self) -> int:
        """End of the last segment (0 when there is none)."""
        return int(self.ends[-1]) if self.starts.numel() else 0

    @property
    def lengths(self) -> Tensor:
        """[S] int64: tokens per segment, anchor included."""
        return self.ends - self.starts

    @property
    def anchors(self) -> Tensor:
        """[A] int64: token indices of the anchors, ascending."""
        return self.starts[self.is_anchor]

    def take(self, index: ArrayLike) -> "Segments":
        """The segments at ``index`` (ints or a bool mask over segments), in order."""
        idx = torch.as_tensor(index)
        if idx.dtype == torch.bool:
            if idx.shape != self.starts.shape:
                raise ValueError("a boolean index must have one entry per segment")
        else:
            idx = idx.to(torch.int64)
            if idx.numel() and bool((idx[1:] <= idx[:-1]).any()):
                raise ValueError("index must be strictly increasing")
        return Segments(self.starts[idx], self.ends[idx], self.is_anchor[idx])

    def segment_of(self, tokens: ArrayLike) -> Tensor:
        """Segment index of each token (int64, same shape), -1 for a token in no segment."""
        t = _as_int64(tokens)
        s = torch.searchsorted(self.starts, t, right=True) - 1
        inside = (s >= 0) & (t < self.ends[s.clamp_min(0)]) if self.num_segments else s >= 0
        return torch.where(inside, s, torch.full_like(s, -1))


class SurprisalSegmenter:
    """Incremental segmentation of one session; identical to :func:`segment` on the
    concatenation of everything pushed, however it was chunked.

    ``push(chunk)`` takes the surprisals of the next tokens and returns the anchors
    among them (absolute token indices, int64). :meth:`segments` returns all
    segments so far; the last one is still open (it may grow with the next push).
    Memory: O(number of segments). Not thread-safe.
    """

    def __init__(self, alpha: float = DEFAULT_ALPHA,
                 max_segment_tokens: Optional[int] = DEFAULT_MAX_SEGMENT_TOKENS) -> None:
        self.alpha = check_alpha(alpha)
        self.max_segment_tokens = _check_max_segment_tokens(max_segment_tokens)
        self.num_tokens = 0          # tokens pushed so far (= index of the next token)
        self._count = 0              # tokens in the statistics (all but token 0)
        self._shift = 0.0            # K: value of token 1
        self._sum = 0.0              # sum of (H - K)
        self._sumsq = 0.0            # sum of (H - K)^2
        self._last_anchor = -1
        self._starts: list[np.ndarray] = []
        self._is_anchor: list[np.ndarray] = []

    @property
    def mean(self) -> float:
        """Running mean of the sanitized surprisals of tokens 1.. (NaN before any)."""
        return self._shift + self._sum / self._count if self._count else math.nan

    @property
    def std(self) -> float:
        """Running population standard deviation (NaN before any token 1..)."""
        if not self._count:
            return math.nan
        m = self._sum / self._count
        return math.sqrt(max(self._sumsq / self._count - m * m, 0.0))

    def push(self, surprisal_chunk: ArrayLike) -> Tensor:
        """Add the next tokens' surprisals [m]; return the anchors among them [A] int64."""
        x = clean_surprisal(surprisal_chunk)
        m = x.shape[0]
        first = self.num_tokens
        idx = np.arange(first, first + m, dtype=np.int64)
        anchor = np.zeros(m, dtype=bool)
        off = 0
        if first == 0 and m:
            anchor[0] = True  # token 0: anchor by definition, outside the statistics
            off = 1
        y = x[off:]
        if y.size:
            if self._count == 0:
                self._shift = float(y[0])
            y = y - self._shift
            a = np.add.accumulate(np.concatenate(([self._sum], y)))[1:]
            b = np.add.accumulate(np.concatenate(([self._sumsq], y * y)))[1:]
            n = np.arange(self._count + 1, self._count + 1 + y.size, dtype=np.float64)
            mean = a / n
            std = np.sqrt(np.maximum(b / n - mean * mean, 0.0))
            anchor[off:] = y > mean + self.alpha * std
            self._sum, self._sumsq = float(a[-1]), float(b[-1])
            self._count += int(y.size)
        boundary = anchor
        if m:
            last = np.maximum.accumulate(np.concatenate(([self._last_anchor], np.where(anchor, idx, -1))))[1:]
            if self.max_segment_tokens is not None:
                cut = ~anchor & ((idx - last) % self.max_segment_tokens == 0)
                boundary = anchor | cut
            self._last_anchor = int(last[-1])
            self._starts.append(idx[boundary])
            self._is_anchor.append(anchor[boundary])
        self.num_tokens = first + m
        return torch.from_numpy(idx[anchor].copy())

    def segments(self) -> Segments:
        """All segments so far (tiling ``[0, num_tokens)``; the last one is open)."""
        starts = np.concatenate(self._starts) if self._starts else np.zeros(0, np.int64)
        is_anchor = np.concatenate(self._is_anchor) if self._is_anchor else np.zeros(0, bool)
        ends = np.append(starts[1:], self.num_tokens).astype(np.int64) if starts.size else starts
        return Segments(torch.from_numpy(starts), torch.from_numpy(ends), torch.from_numpy(is_anchor))


def segment(surprisal: ArrayLike, alpha: float = DEFAULT_ALPHA,
            max_segment_tokens: Optional[int] = DEFAULT_MAX_SEGMENT_TOKENS) -> Segments:
    """Segments of a whole sequence's surprisal [T] (see the module docstring)."""
    seg = SurprisalSegmenter(alpha, max_segment_tokens)
    seg.push(surprisal)
    return seg.segments()


# ---------------------------------------------------------------- blocks (bookkeeping)


def segment_block_ranges(segments: Segments, block_tokens: int) -> tuple[Tensor, Tensor]:
    """Blocks each segment touches: ``(first_block [S], end_block [S])``, int64,
    segment s overlaps blocks ``first_block[s] <= b < end_block[s]``."""
    bt = _check_block_tokens(block_tokens)
    return segments.starts // bt, (segments.ends - 1) // bt + 1


def block_segment_ranges(segments: Segments, block_tokens: int,
                         num_blocks: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """Segments each block touches: ``(first_segment [B], end_segment [B])``, int64;
    block b overlaps segments ``first_segment[b] <= s < end_segment[b]`` (an empty
    range for a block no segment reaches). ``num_blocks`` defaults to the blocks
    up to the last segment's end."""
    bt = _check_block_tokens(block_tokens)
    if num_blocks is None:
        num_blocks = -(-segments.num_tokens // bt)
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, (int, np.integer)) or num_blocks < 0:
        raise ValueError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
    block_start = torch.arange(num_blocks, dtype=torch.int64) * bt
    first = torch.searchsorted(segments.ends, block_start, right=True)     # first segment ending after it
    end = torch.searchsorted(segments.starts, block_start + bt, right=False)  # segments starting before its end
    return first, torch.maximum(end, first)


def block_anchor_mask(segments: Segments, block_tokens: int, num_blocks: Optional[int] = None) -> Tensor:
    """``[num_blocks, block_tokens]`` bool: which tokens of each block are anchors.
    ``num_blocks`` defaults to the blocks up to the last segment's end; anchors
    beyond ``num_blocks`` blocks are ignored."""
    bt = _check_block_tokens(block_tokens)
    if num_blocks is None:
        num_blocks = -(-segments.num_tokens // bt)
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, (int, np.integer)) or num_blocks < 0:
        raise ValueError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
    mask = torch.zeros(num_blocks * bt, dtype=torch.bool)
    anchors = segments.anchors
    mask[anchors[anchors < num_blocks * bt]] = True
    return mask.reshape(num_blocks, bt)


def anchors_by_surprisal(segments: Segments | None, surprisal: np.ndarray | None) -> list[int]:
    """The history's anchors (virtual positions) but token 0, the most
    surprising first; none without segments (no recorded surprisal)."""
    if segments is None:
        return []
    anchors = segments.anchors.numpy()
    anchors = anchors[anchors > 0]  # token 0 is an anchor by definition, and in the sink
    order = np.argsort(-np.nan_to_num(surprisal[anchors], nan=0.0), kind="stable")
    return anchors[order].tolist()
