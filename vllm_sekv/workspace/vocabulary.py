"""What a view reads from its model's tokenizer, found once per server with
one decode of each id of the vocabulary (`Vocabulary.of`).

* `breaks`: the ids that end passages and lines (`passages.BreakTokens`).
* `words`: each id's **word**: the first id of the vocabulary whose text,
  without the spaces and underscores it begins with, is the same as its own.
  `_MIN`, ` MIN` and `MIN` are one word: the piece of a name written
  `X_MIN`, `(MIN` or `\\n_MIN`, which a byte-pair tokenizer splits into
  different tokens by what precedes it. Look-alikes (`index.lookalikes`)
  compare names by words.
* `turns`: the tokenizer's special ids, which start and end a chat turn:
  look-alikes find the question's own turn by them.

Pure numpy after the decode, no vLLM, blocking.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_sekv.workspace.passages import BreakTokens, break_tokens_of, decoded_vocabulary

WORD_PREFIX = " _"  # the characters a token's text may begin with and still spell its word


@dataclass(frozen=True)
class Vocabulary:
    """A tokenizer's break tokens, words and turn tokens (see the module)."""

    breaks: BreakTokens
    words: np.ndarray | None = None  # int64 [vocabulary size]; None: each id is its own word
    turns: np.ndarray | None = None  # sorted int64 special ids; None: unknown (the whole query is the question)

    @classmethod
    def of(cls, tokenizer) -> Vocabulary:
        """`tokenizer`'s vocabulary facts (about 2 s for Qwen2.5's 152K ids on a 2-core CPU)."""
        texts, special = decoded_vocabulary(tokenizer)
        return cls(break_tokens_of(texts, special), words_of(texts, special),
                   np.asarray(sorted(special), dtype=np.int64))


def words_of(texts: list[str], special: set[int]) -> np.ndarray:
    """Each id's word (see the module) for the vocabulary `texts`; a special
    id, or one whose text is all spaces and underscores, is its own."""
    first: dict[str, int] = {}
    words = np.arange(len(texts), dtype=np.int64)
    for i, text in enumerate(texts):
        word = text.lstrip(WORD_PREFIX)
        if word and i not in special:
            words[i] = first.setdefault(word, i)
    return words
