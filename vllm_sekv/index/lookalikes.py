"""Look-alikes: history blocks written in the template of the evidence a
view found, about something else.

An agent's history repeats templates: `VAR X = VAR Y` lines, "the special
magic number for K is N", a deploy key per service. Attention over the keys
rates every line of a template alike, so the blocks a view ranks best hold,
beside the asked fact, the same template's other instances, and a model
reading them answers with the wrong one's value (the oracle's prompt, which
holds the asked turns only, does not). What tells them apart is a few rare
tokens (the name), which BM25 over token ids sees and attention does not.

Definitions, over terms (a token id's word, `workspace.vocabulary`: `_MIN`
and ` MIN` are one term; or the id itself), for the step's new tokens (the
*query*) and a *lead* block (where the question leads):

* A **rare** token is one that at most `RARE_SHARE` of the history blocks
  hold, or `RARE_BLOCKS` in a short history (a name, an identifier).
* The **lead** block is, of the first probe's best `LEAD_CANDIDATES`
  blocks, the one holding the most of the rare tokens of the query's last
  `QUESTION_TOKENS` (each counted as often as it occurs there; ties: the
  better ranked). The query can begin with the previous exchange (an answer
  naming an earlier question's fact), which the probe's attention follows
  too; its end is the question's own turn, which names what it asks.
* The **lead lines** are the lead block's tokens with the rest of the lines
  its boundaries cut (`workspace.passages.Passages.line_span`; the block
  alone where no line breaks are known): a chain's line `VAR X = VAR Y` cut
  after `VAR` leaves the name it points to in the next block.
* The **top** is the ranking's best eighth of the candidates, at most
  `TOP_RANKED`. A token's **history share** is the share of history blocks
  that hold it; its **top share** the share of the top's blocks. A token of
  the lead lines is **gathered** where its top share is at least `LIFT`
  times its history share: the ranking gathers its occurrences (`VAR`,
  `magic`, an asked constant's name), where a word of the prose or code
  around them (`the`, `def`) is as common everywhere and is not.
* The **asked tokens** are the rare tokens that the lead lines share with
  the query's last `QUESTION_TOKENS`. A block holds a token **about
  something else** than a name where it does not hold every other token of
  the name (every block, where the name has no other token).
* The **asked name** (the template's slot) is the asked tokens that are not
  gathered or that fewer than `TEMPLATE_BLOCKS` of the top's blocks hold
  about something else than the asked tokens: `brisk` and `zephyr`; or an
  asked constant's pieces, which its definition and its uses hold together.
  An asked token that instances about other things share (`magic`) is not
  part of it.
* A **template token** is a gathered token of the lead lines outside the
  asked name that at least `TEMPLATE_BLOCKS` of the top's blocks hold about
  something else than the asked name.
* The **question** is the query from the start of the chat turn that holds
  its last `QUESTION_TOKENS`: the tokens after the last *turn token* (a
  special token of the tokenizer) at or before the first of those; the
  whole query where turn tokens are unknown or none lies there. It is the
  asked turn and the answer's start, not the previous exchange or the
  history's end that the query can begin with, whose names are not asked
  (an earlier answer names the chain it followed).
* A **distinctive token** is a rare token of the lead lines or of the
  question that is neither a template token nor of the asked name.
* A candidate's **lines** are its block with the rest of the lines its
  boundaries cut, where the caller gives them (`spans`); else the block.
* A **look-alike** is a candidate not holding lead lines whose lines hold a
  template token, and neither the whole asked name nor a distinctive
  token: the template, about something the question does not name, also
  where its name shares a piece with the asked one (`quiet-zephyr` beside
  `brisk-zephyr`) or where the block holds only a cut line's end (the value
  after the name). Without template tokens nothing is a look-alike, nor in
  a history shorter than `LIFT` times the top (512 blocks), where no
  token's share can rise that far; in prose and code the ranking gathers a
  topic's words and a file's identifiers too, and their other occurrences
  are look-alikes there.

Pure numpy, blocking, no vLLM imports; inputs are never modified.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

TOP_RANKED = 32  # at most this many best candidates, whose shared tokens make a template
TEMPLATE_BLOCKS = 3  # of them must hold a token of the lead lines about something else for it to be template
LIFT = 16  # and its share of them must be this many times its share of the history
RARE_SHARE = 0.01  # at most this share of the history blocks hold a rare token
RARE_BLOCKS = 4  # or at most this many
LEAD_CANDIDATES = 4  # the first probe's best blocks the lead block is chosen from
QUESTION_TOKENS = 32  # the query's last tokens, whose rare tokens choose it


def _holding(history: np.ndarray, terms: np.ndarray, block_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(`held[b, t]`: whether whole block b of `history` holds `terms[t]`
    (sorted, unique), how many blocks hold each term)."""
    num_blocks = len(history) // block_tokens
    tokens = np.asarray(history[: num_blocks * block_tokens], dtype=np.int64).reshape(num_blocks, block_tokens)
    held = np.zeros((num_blocks, len(terms)), dtype=bool)
    where = np.isin(tokens, terms)
    held[np.nonzero(where)[0], np.searchsorted(terms, tokens[where])] = True
    return held, held.sum(axis=0)


def _holding_spans(history: np.ndarray, terms: np.ndarray, spans: np.ndarray) -> np.ndarray:
    """`held[i, t]`: whether `history[spans[i, 0]:spans[i, 1]]` holds `terms[t]` (sorted, unique)."""
    lengths = spans[:, 1] - spans[:, 0]
    seg = np.repeat(np.arange(len(spans)), lengths)
    idx = np.arange(int(lengths.sum())) + np.repeat(spans[:, 0] - (np.cumsum(lengths) - lengths), lengths)
    tokens = np.asarray(history, dtype=np.int64)[idx]
    held = np.zeros((len(spans), len(terms)), dtype=bool)
    where = np.isin(tokens, terms)
    held[seg[where], np.searchsorted(terms, tokens[where])] = True
    return held


def _elsewhere(held: np.ndarray, name: np.ndarray) -> np.ndarray:
    """For each term, how many of the blocks `held` (`[blocks, terms]`) hold
    it but not every other term of `name` (a mask over terms; every block
    where `name` has no other term): its occurrences about something else."""
    needed = name.sum() - name
    others = held[:, name].sum(axis=1, keepdims=True) - (held & name)
    return (held & ((others < needed) | (needed == 0))).sum(axis=0)


def as_words(ids: Sequence[int] | np.ndarray, words: np.ndarray) -> np.ndarray:
    """`ids`' words; an id past the tokenizer's vocabulary (a model's padded
    rows) is its own."""
    ids = np.asarray(ids, dtype=np.int64)
    inside = (ids >= 0) & (ids < len(words))
    return np.where(inside, words[np.where(inside, ids, 0)], ids)


def _rare(history_count: np.ndarray, num_blocks: int) -> np.ndarray:
    """Whether each token held by `history_count` of `num_blocks` history blocks is rare."""
    return history_count <= max(RARE_SHARE * num_blocks, RARE_BLOCKS)


def lead_block(history: np.ndarray, best: Sequence[int], query: Sequence[int], block_tokens: int) -> int:
    """The lead block (see the module's definitions) among `best`, the first
    probe's best blocks of `history`, best first (non-empty; only the first
    `LEAD_CANDIDATES` are considered); `query`: the step's new tokens."""
    best = list(best)[:LEAD_CANDIDATES]
    terms, counts = np.unique(np.asarray(query[-QUESTION_TOKENS:], dtype=np.int64), return_counts=True)
    if len(best) == 1 or len(terms) == 0:
        return best[0]
    held, history_count = _holding(history, terms, block_tokens)
    weight = np.where(_rare(history_count, len(held)) & (history_count > 0), counts, 0)
    scores = held[best].astype(np.int64) @ weight
    return best[int(np.argmax(scores))]  # the first of the highest: the better ranked


def question_of(query: Sequence[int] | np.ndarray, turns: np.ndarray | None) -> np.ndarray:
    """The question of `query` (see the module's definitions); `turns`: the
    tokenizer's turn tokens (sorted int64 ids), None: the whole query."""
    query = np.asarray(query, dtype=np.int64)
    if turns is None:
        return query
    first = max(len(query) - QUESTION_TOKENS, 0)
    starts = np.flatnonzero(np.isin(query[: first + 1], turns))
    return query[starts[-1] + 1:] if len(starts) else query


def lookalike_mask(history: np.ndarray, candidates: Sequence[int], order: Sequence[int], lead: tuple[int, int],
                   query: Sequence[int], block_tokens: int, spans: np.ndarray | None = None,
                   words: np.ndarray | None = None, turns: np.ndarray | None = None) -> np.ndarray:
    """Which of `candidates` (block indices of `history`, token ids in
    virtual order) are look-alikes of the lead lines `history[lead[0]:
    lead[1]]` (see the module's definitions). `order`: indices into
    `candidates`, best first (the view's ranking); `query`: the step's new
    tokens; `spans`: each candidate's lines, `[len(candidates), 2]` token
    ranges (`Passages.line_spans`), None: the blocks alone; `words`: each
    token id's word (`workspace.vocabulary`), by which tokens are terms, None:
    each id is its own; `turns`: the tokenizer's turn tokens, which delimit
    the question (`question_of`). Bool `[len(candidates)]`."""
    candidates = np.asarray(candidates, dtype=np.int64)
    query = question_of(query, turns)
    if words is not None:
        history, query = as_words(history, words), as_words(query, words)
    num_blocks = len(history) // block_tokens
    mask = np.zeros(len(candidates), dtype=bool)
    if num_blocks == 0 or len(candidates) == 0:
        return mask
    start, end = lead
    lead_terms = np.unique(np.asarray(history[start:end], dtype=np.int64))
    terms = np.union1d(lead_terms, np.asarray(query, dtype=np.int64))
    held, history_count = _holding(history, terms, block_tokens)
    rare, in_lead = _rare(history_count, num_blocks), np.isin(terms, lead_terms)
    asked = rare & in_lead & np.isin(terms, np.asarray(query[-QUESTION_TOKENS:], dtype=np.int64))
    top = held[candidates[np.asarray(order, dtype=np.int64)[: min(TOP_RANKED, max(len(candidates) // 8, 1))]]]
    lifted = top.sum(axis=0) * num_blocks >= LIFT * history_count * len(top)
    gathered = in_lead & lifted
    slot = asked & ~(gathered & (_elsewhere(top, asked) >= TEMPLATE_BLOCKS))
    template = gathered & ~slot & (_elsewhere(top, slot) >= TEMPLATE_BLOCKS)
    if not template.any():
        return mask
    lines = held[candidates] if spans is None else _holding_spans(history, terms, np.asarray(spans, np.int64))
    keep = lines[:, rare & ~template & ~slot].any(axis=1)  # a distinctive token
    if slot.any():
        keep |= lines[:, slot].all(axis=1)
    mask = lines[:, template].any(axis=1) & ~keep
    mask[(candidates >= start // block_tokens) & (candidates <= (end - 1) // block_tokens)] = False
    return mask
