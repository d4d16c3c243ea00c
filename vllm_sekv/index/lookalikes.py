"""Look-alikes: history blocks written in the template of the evidence a
view found, about something else.

An agent's history repeats templates: `VAR X = VAR Y` lines, "the special
magic number for K is N", a deploy key per service. Attention over the keys
rates every line of a template alike, so the blocks a view ranks best hold,
beside the asked fact, the same template's other instances, and a model
reading them answers with the wrong one's value (the oracle's prompt, which
holds the asked turns only, does not). What tells them apart is a few rare
tokens (the name), which BM25 over token ids sees and attention does not.

Definitions, over token ids (a term is a token id), for a *lead* block
(the first probe's best: where the step's question led) and the step's new
tokens (the *query*):

* The **top** is the ranking's best eighth of the candidates, at most
  `TOP_RANKED`. A token's **history share** is the share of history blocks
  that hold it; its **top share** the share of the top's blocks.
* A **template token** is a token of the lead block that at least
  `TEMPLATE_BLOCKS` of the top's blocks hold, with a top share at least
  `LIFT` times its history share: the ranking gathers its occurrences
  (`VAR`, `magic`), where a word of the prose or code around them (`the`,
  `def`) is as common everywhere and is not one.
* A **distinctive token** is a token of the lead block or of the query, not a
  template token, that at most `RARE_SHARE` of the history blocks hold, or
  `RARE_BLOCKS` in a short history (a name, an identifier).
* A **look-alike** is a candidate other than the lead block that holds a
  template token and no distinctive token: the template, about something
  the question does not name. Without template tokens (paragraphs of prose,
  code) nothing is a look-alike, nor in a history shorter than `LIFT`
  times the top (512 blocks), where no token's share can rise that far.

Pure numpy, blocking, no vLLM imports; inputs are never modified.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

TOP_RANKED = 32  # at most this many best candidates, whose shared tokens make a template
TEMPLATE_BLOCKS = 3  # of them must hold a token of the lead block for it to be template
LIFT = 16  # and its share of them must be this many times its share of the history
RARE_SHARE = 0.01  # at most this share of the history blocks hold a distinctive token
RARE_BLOCKS = 4  # or at most this many


def lookalike_mask(history: np.ndarray, candidates: Sequence[int], order: Sequence[int], lead: int,
                   query: Sequence[int], block_tokens: int) -> np.ndarray:
    """Which of `candidates` (block indices of `history`, token ids in
    virtual order) are look-alikes of block `lead` (see the module's
    definitions). `order`: indices into `candidates`, best first (the
    view's ranking); `query`: the step's new tokens. Bool `[len(candidates)]`."""
    candidates = np.asarray(candidates, dtype=np.int64)
    num_blocks = len(history) // block_tokens
    mask = np.zeros(len(candidates), dtype=bool)
    if num_blocks == 0 or len(candidates) == 0:
        return mask
    tokens = np.asarray(history[: num_blocks * block_tokens], dtype=np.int64).reshape(num_blocks, block_tokens)
    lead_terms = np.unique(tokens[lead])
    terms = np.union1d(lead_terms, np.asarray(query, dtype=np.int64))
    held = np.zeros((num_blocks, len(terms)), dtype=bool)  # held[b, t]: block b holds term t
    where = np.isin(tokens, terms)
    rows = np.nonzero(where)[0]
    held[rows, np.searchsorted(terms, tokens[where])] = True
    history_count = held.sum(axis=0)
    top = candidates[np.asarray(order, dtype=np.int64)[: min(TOP_RANKED, max(len(candidates) // 8, 1))]]
    top_count = held[top].sum(axis=0)
    lifted = top_count * num_blocks >= LIFT * history_count * len(top)
    template = np.isin(terms, lead_terms) & (top_count >= TEMPLATE_BLOCKS) & lifted
    if not template.any():
        return mask
    distinctive = ~template & (history_count <= max(RARE_SHARE * num_blocks, RARE_BLOCKS))
    mask = held[candidates][:, template].any(axis=1) & ~held[candidates][:, distinctive].any(axis=1)
    mask[candidates == lead] = False
    return mask
