"""Lexical relevance of history blocks, and its fusion with the block index's.

The block index ranks history blocks by the new tokens' attention to their
keys; it finds what the model would look at, but can miss a passage that
shares the question's rare words and little else (a paragraph of reference
text among many alike). Text retrieval finds those. This module scores every
history block with Okapi BM25 over token ids (no text, no tokenizer: a term is
a token id, so subword pieces of a rare word are rare terms too), the new
tokens as the query, and fuses it with the index's ranking (`fuse`).

A block's lexical score is its own BM25 score plus that of the window of
`WINDOW_BLOCKS` blocks centred on it: a passage scores as a whole (every
block of it shares the window's score, its neighbours too), and within it
the blocks that hold the query's terms come first. Document frequencies
count blocks.

`question_passages` ranks the history's passages instead, as text retrieval
ranks a document's: Okapi BM25 with length normalisation over passages of at
most `PASSAGE_TOKENS` tokens, against the terms of the question alone (the
caller maps tokens to words, so a name's pieces are terms whatever precedes
them). Pure numpy, blocking, no vLLM imports; inputs are never modified.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

WINDOW_BLOCKS = 8  # blocks per scored window (256 tokens at 32-token blocks): a paragraph
K1 = 1.2  # BM25 term-frequency saturation
RRF_K = 60  # reciprocal-rank constant of `fuse` (as in reciprocal-rank fusion)
PASSAGE_TOKENS = 256  # `question_passages` scores a longer passage in pieces of this many tokens
LENGTH_NORM = 0.75  # BM25's b: how far `question_passages` discounts a long passage's term counts


def block_scores(history: np.ndarray, query: Sequence[int], block_tokens: int,
                 window_blocks: int = WINDOW_BLOCKS) -> np.ndarray:
    """BM25 score of each whole block of `history` (token ids, virtual order)
    against the token ids `query` (duplicates count once): the block's own
    plus its window's (`window_blocks` blocks around it; 0: the block's own
    only, so that a query taken from one block does not lift that block's
    neighbours). Returns float64 `[len(history) // block_tokens]`; 0 where
    no query term occurs nearby."""
    num_blocks = len(history) // block_tokens
    terms = np.unique(np.asarray(query, dtype=np.int64))
    if num_blocks == 0 or len(terms) == 0:
        return np.zeros(num_blocks)
    tokens = np.asarray(history[: num_blocks * block_tokens], dtype=np.int64)
    hit = np.flatnonzero(np.isin(tokens, terms))
    counts = np.zeros((num_blocks, len(terms)))
    np.add.at(counts, (hit // block_tokens, np.searchsorted(terms, tokens[hit])), 1.0)
    df = (counts > 0).sum(axis=0)
    idf = np.log1p((num_blocks - df + 0.5) / (df + 0.5))
    if window_blocks == 0:
        return _bm25(counts, idf)
    # Window sums: rows [b - window_blocks // 2, b + window_blocks - window_blocks // 2).
    cumulative = np.vstack([np.zeros((1, len(terms))), np.cumsum(counts, axis=0)])
    lo = np.clip(np.arange(num_blocks) - window_blocks // 2, 0, num_blocks)
    hi = np.clip(lo + window_blocks, 0, num_blocks)
    window = cumulative[hi] - cumulative[lo]
    return _bm25(counts, idf) + _bm25(window, idf)


def _bm25(tf: np.ndarray, idf: np.ndarray) -> np.ndarray:
    """Σ over terms of idf x saturated term frequency (documents of about
    equal length: no length normalisation)."""
    return (idf * tf * (K1 + 1) / (tf + K1)).sum(axis=1)


def _ranks(scores: np.ndarray) -> np.ndarray:
    """0-based rank of each score, best first; ties go to the later index."""
    order = np.lexsort((-np.arange(len(scores)), -scores))
    ranks = np.empty(len(scores), dtype=np.int64)
    ranks[order] = np.arange(len(scores))
    return ranks


def fuse(index_scores: Sequence[float], lexical_scores: Sequence[float], weight: float) -> np.ndarray:
    """The index's reciprocal rank plus the lexical score scaled to the best
    one's: `1 / (RRF_K + rank_index) + weight * lexical / max(lexical) / RRF_K`
    per candidate. The lexically best block gains what the index's best one
    has; a block that shares only common terms with the query (a score near
    0) gains next to nothing, where a lexical *rank* would give it as much as
    its place among the noise. Same length as the inputs; larger is better."""
    index_scores = np.asarray(index_scores, dtype=np.float64)
    lexical_scores = np.asarray(lexical_scores, dtype=np.float64)
    if index_scores.shape != lexical_scores.shape:
        raise ValueError(f"fuse: {index_scores.shape} index scores against {lexical_scores.shape} lexical ones")
    fused = 1.0 / (RRF_K + _ranks(index_scores))
    best = lexical_scores.max(initial=0.0)
    return fused + (weight / RRF_K) * lexical_scores / best if best > 0 else fused


def hop_scores(history: np.ndarray, lead: tuple[int, int], candidates: Sequence[int], block_tokens: int) -> np.ndarray:
    """A lexical hop from the lead: the BM25 score of each of `candidates`
    (block indices of `history`) scored alone against the token ids of
    `history[lead[0]:lead[1]]` (the lead block with the rest of the lines its
    boundaries cut, `index.lookalikes`; no window, so the lead's own
    neighbours gain nothing from it); a block holding lead tokens scores -inf.
    A line that names another (`VAR X = VAR Y`) shares that name's rare tokens
    with the line it points to (`VAR Y = 42`) and little else, where
    attention over the keys rates every line of the same template alike; the
    name can lie past the block's boundary, hence the whole line. Float64
    `[len(candidates)]`."""
    start, end = lead
    candidates = np.asarray(candidates, dtype=np.int64)
    scores = block_scores(history, np.asarray(history[start:end]), block_tokens, window_blocks=0)[candidates]
    scores[(candidates >= start // block_tokens) & (candidates <= (end - 1) // block_tokens)] = -np.inf
    return scores


def question_passages(history: np.ndarray, question: Sequence[int], starts: Sequence[int], count: int,
                      piece_tokens: int = PASSAGE_TOKENS) -> list[tuple[int, int]]:
    """The `count` token ranges `[start, end)` of `history` that Okapi BM25
    ranks best against the terms of `question` (each once), best first
    (ties: the earlier). The ranges are the passages beginning at `starts`
    (token indices, ascending; the history's first passage begins at 0
    whether or not it is given), each cut into pieces of at most
    `piece_tokens` tokens; a range holding no term of the question is never
    returned. Document frequencies count ranges."""
    tokens = np.asarray(history, dtype=np.int64)
    terms = np.unique(np.asarray(question, dtype=np.int64))
    if count <= 0 or len(tokens) == 0 or len(terms) == 0:
        return []
    starts = np.union1d([0], np.asarray(starts, dtype=np.int64))
    starts = starts[starts < len(tokens)]
    lengths = np.diff(np.append(starts, len(tokens)))
    pieces = -(-lengths // piece_tokens)
    # piece j of passage p: from starts[p] + j * piece_tokens, at most piece_tokens, within the passage
    passage = np.repeat(np.arange(len(starts)), pieces)
    within = np.arange(len(passage)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    first = starts[passage] + within * piece_tokens
    ends = np.minimum(first + piece_tokens, starts[passage] + lengths[passage])
    hit = np.flatnonzero(np.isin(tokens, terms))
    counts = np.zeros((len(first), len(terms)))
    np.add.at(counts, (np.searchsorted(first, hit, side="right") - 1, np.searchsorted(terms, tokens[hit])), 1.0)
    df = (counts > 0).sum(axis=0)
    idf = np.log1p((len(first) - df + 0.5) / (df + 0.5))
    size = ends - first
    saturation = K1 * (1 - LENGTH_NORM + LENGTH_NORM * size / size.mean())
    scores = (idf * counts * (K1 + 1) / (counts + saturation[:, None])).sum(axis=1)
    best = np.argsort(-scores, kind="stable")[:count]
    return [(int(first[i]), int(ends[i])) for i in best if scores[i] > 0]
