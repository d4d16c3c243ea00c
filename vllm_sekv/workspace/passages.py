"""Passages: the paragraphs and turns a history is written in, in whole blocks.

A view selects history in fixed blocks of `block_tokens`; a fact, a
document or a function rarely fits one. With `view_passage_blocks` a
selected block brings the rest of its *passage*, so the view holds whole
paragraphs the way a prompt would, not fragments cut at block boundaries.

Definitions (the contract of this module):

* A **break token** ends a passage: a special token of the tokenizer (a chat
  turn's start or end), a token whose text holds a blank line (`"\\n\\n"`),
  or a token starting with a newline right after one ending with one (a
  blank line split over two tokens). `break_token_ids` finds them in a
  vocabulary once.
* **Passage k** is the run of tokens after the (k-1)-th break token up to
  and including the k-th (the first passage starts at token 0; the last runs
  to the end of the history).
* A block's **home** passage is the one holding the block's middle token
  (`block * block_tokens + block_tokens // 2`). A passage's **span** is every
  block that holds one of its tokens, so the blocks at its two ends are
  shared with its neighbours, and a passage comes with its first and last
  tokens.
* With the *line* breaks instead (`BreakTokens.lines`: every token whose
  text holds a newline, and the special tokens), passages are **lines**.
  `Passages.cut(block)` is what a block boundary cut off a short line at
  either end of `block`: the neighbour holding the rest of the line through
  the block's first token (its last token), when that line spans just the
  two blocks (`view_cut_lines`: a chain's line `VAR X = VAR Y` split after
  `VAR X`, where only one half ranks). `Passages.line_span(block)` is the
  same in tokens: the block's own tokens with the rest of those lines.
* `Passages.around(block, most)` is the block, then the other blocks of its
  home passage's span nearest first (the earlier one first at equal
  distance), when the span has at most `most` blocks; else the block alone.
  A passage comes whole or not at all: a window of a longer one (a line's
  neighbourhood in a long turn) is only its neighbours, which cost a view
  room without making a unit whole (measured: such windows lost answers on
  chains of single lines in long turns).

Pure numpy, no vLLM, blocking; inputs are never modified.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

PARAGRAPH_BREAK = "\n\n"


@dataclass(frozen=True)
class BreakTokens:
    """The token ids that end passages, as sorted int64 arrays: `whole`, a
    token that ends one alone (special tokens, text holding a blank line);
    a token of `opens` (text starting with a newline) right after one of
    `closes` (text ending with one), a blank line split over two tokens."""

    whole: np.ndarray
    closes: np.ndarray
    opens: np.ndarray
    newlines: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # text holding a newline

    def lines(self) -> "BreakTokens":
        """The breaks that end lines: a token holding a newline, a special token."""
        none = np.zeros(0, dtype=np.int64)
        return BreakTokens(np.union1d(self.whole, self.newlines), none, none)

    def positions(self, tokens: np.ndarray) -> np.ndarray:
        """Indices of `tokens` (int64 ids) that end a passage, ascending: the
        break tokens, of a run of them only the last (`"\\n"` x 3 is one break)."""
        ends = np.isin(tokens, self.whole)
        if len(tokens) > 1:
            ends[1:] |= np.isin(tokens[1:], self.opens) & np.isin(tokens[:-1], self.closes)
            ends[:-1] &= ~ends[1:]
        return np.flatnonzero(ends)


def break_token_ids(tokenizer) -> BreakTokens:
    """`tokenizer`'s break tokens. One decode of each id of the vocabulary
    (0.1 s for SmolLM2's 49K ids on one CPU core); do it once per server."""
    return break_tokens_of(*decoded_vocabulary(tokenizer))


def decoded_vocabulary(tokenizer) -> tuple[list[str], set[int]]:
    """(the text of each id of `tokenizer`'s vocabulary, its special ids)."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    special = {int(i) for i in tokenizer.all_special_ids}
    special.update(int(i) for i, added in getattr(tokenizer, "added_tokens_decoder", {}).items()
                   if getattr(added, "special", False))
    return texts, special


def break_tokens_of(texts: list[str], special: set[int]) -> BreakTokens:
    """The break tokens of a vocabulary (`decoded_vocabulary`)."""

    def ids(keep) -> np.ndarray:
        return np.asarray([i for i, text in enumerate(texts) if i not in special and keep(text)], dtype=np.int64)

    whole = ids(lambda text: PARAGRAPH_BREAK in text)
    whole = np.union1d(whole, np.asarray(sorted(i for i in special if 0 <= i < len(texts)), dtype=np.int64))
    return BreakTokens(whole, ids(lambda text: text.endswith("\n")), ids(lambda text: text.startswith("\n")),
                       ids(lambda text: "\n" in text))


class Passages:
    """The passages of a history's whole blocks, found from its token ids."""

    def __init__(self, history: Sequence[int] | np.ndarray, breaks: BreakTokens, block_tokens: int) -> None:
        """`history`: token ids in virtual order (only its whole blocks count);
        `breaks`: the tokenizer's break tokens (`break_token_ids`)."""
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.block_tokens = block_tokens
        self.num_blocks = len(history) // block_tokens
        tokens = np.asarray(history[: self.num_blocks * block_tokens], dtype=np.int64)
        ends = breaks.positions(tokens)  # last token of each passage but the last
        # Passage k: tokens (ends[k-1], ends[k]]; its span in blocks [first, last].
        first_token = np.concatenate(([0], ends + 1))
        last_token = np.concatenate((ends, [max(len(tokens) - 1, 0)]))
        keep = first_token <= last_token  # a break at the very end opens no passage
        self._first = first_token[keep] // block_tokens
        self._last = last_token[keep] // block_tokens
        self._first_token = first_token[keep]
        self._last_token = last_token[keep]
        middle = np.arange(self.num_blocks, dtype=np.int64) * block_tokens + block_tokens // 2
        self._home = np.searchsorted(self._last_token, middle, side="left")

    @property
    def num_passages(self) -> int:
        return len(self._first)

    @property
    def starts(self) -> np.ndarray:
        """The token index where each passage begins (ascending, int64; a copy)."""
        return self._first_token.copy()

    def span(self, block: int) -> tuple[int, int]:
        """`(first, last)` block (inclusive) of `block`'s home passage."""
        k = self._home[block]
        return int(self._first[k]), int(self._last[k])

    def cut(self, block: int) -> list[int]:
        """The neighbours of `block` holding the rest of a passage cut at its
        boundaries: `block - 1` where the passage through the block's first
        token starts there, `block + 1` where the one through its last token
        ends there (a passage spanning more blocks is not completed)."""
        start, end = self.line_span(block)
        bt = self.block_tokens
        return [b for b, cut in ((block - 1, start < block * bt), (block + 1, end > block * bt + bt)) if cut]

    def line_span(self, block: int) -> tuple[int, int]:
        """Token range `[start, end)` of `block` with the rest of the passages
        its boundaries cut where those span just two blocks: from the first
        token of the one through the block's first token when that starts in
        `block - 1`, to the last token of the one through its last token when
        that ends in `block + 1`."""
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block {block} is outside the history's {self.num_blocks} blocks")
        start, end = self.line_spans(np.array([block]))[0].tolist()
        return start, end

    def line_spans(self, blocks: np.ndarray) -> np.ndarray:
        """`line_span` of each of `blocks` (int array, each a block of the
        history): `[len(blocks), 2]` int64 token ranges."""
        blocks = np.asarray(blocks, dtype=np.int64)
        if len(blocks) and not (0 <= blocks.min() and blocks.max() < self.num_blocks):
            raise ValueError(f"blocks must lie inside the history's {self.num_blocks} blocks")
        bt = self.block_tokens
        first = np.searchsorted(self._last_token, blocks * bt, side="left")
        last = np.searchsorted(self._last_token, blocks * bt + bt - 1, side="left")
        start = np.where((self._first[first] == blocks - 1) & (self._last[first] == blocks),
                         self._first_token[first], blocks * bt)
        end = np.where((self._last[last] == blocks + 1) & (self._first[last] == blocks),
                       self._last_token[last] + 1, blocks * bt + bt)
        return np.stack([start, end], axis=1).astype(np.int64)

    def around(self, block: int, most: int) -> list[int]:
        """`block`, then its home passage's other blocks nearest first (the
        earlier first at equal distance) if the passage spans at most `most`
        blocks; else `block` alone."""
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block {block} is outside the history's {self.num_blocks} blocks")
        first, last = self.span(block)
        if last - first + 1 > most:
            return [block]
        out = [block]
        for step in range(1, last - first + 1):
            out += [b for b in (block - step, block + step) if first <= b <= last]
        return out


def neighbours(block: int, context_blocks: int) -> Iterable[int]:
    """`block`, then `context_blocks` blocks before it and as many after it
    (`view_context_blocks`; the caller drops any outside the candidates)."""
    return (block, *range(block - context_blocks, block), *range(block + 1, block + context_blocks + 1))


def extent(block: int, context_blocks: int, passages: Passages | None = None,
           passage_blocks: int = 0) -> Iterable[int]:
    """What a selected `block` brings into a view, itself first: its passage
    (`Passages.around`) where `passages` and `passage_blocks` are given, else
    its `neighbours`."""
    if passages is not None and passage_blocks > 0:
        return passages.around(block, passage_blocks)
    return neighbours(block, context_blocks)
