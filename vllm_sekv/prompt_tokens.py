"""Tokenizing an agent's growing prompt without tokenizing its history again.

An agent sends its whole conversation with every step, and vLLM's API server
renders it with the chat template and tokenizes the whole string before the
engine sees the request: 0.35-0.5 s for a 131K-token prompt on one CPU
core, inside the step's time to first token, for a view step whose own work
is a fraction of that. `PromptTokenCache` keeps the token ids of recent long
prompts and tokenizes a new prompt as a recent prompt's ids up to the last
*marker* the two texts share, plus the tokens of the rest.

Exactness. A fast Hugging Face tokenizer first splits a text at its added
tokens, then normalizes, pre-tokenizes and encodes each piece on its own:
a piece's tokens depend on that piece alone. A *marker* is an added special
token that is matched on the raw text, strips nothing around it, and that no
other added token contains, is contained in, or overlaps (chat templates'
message delimiters, such as ChatML's `<|im_start|>` and `<|im_end|>`): every
occurrence of it is split out as that one token. So where two texts agree up
to the end of a marker that starts at character `p`, both split at `p`, and
`tokens(text) == tokens(recent)[:j] + tokens(text[p:])`, `j` being the
marker's token index in the recent prompt. A tokenizer that is not a fast
one, or that has no marker, is left as it is (`reuse_prompt_tokens` returns
None), and a text whose markers and marker tokens do not pair up one to one
is not kept.

Contract: `PromptTokenCache.encode(text)` equals the tokenizer's ids of
`text` without added special tokens, for every text, and a tokenizer given
to `reuse_prompt_tokens` returns what it returned before for every call.
Thread-safe: vLLM's renderer tokenizes on a pool of threads.
"""
from __future__ import annotations

import re
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

MIN_CHARS = 4096
"""Prompts shorter than this are tokenized whole and not kept: they cost
milliseconds."""

MAX_BYTES = 256 << 20
"""The cache's bound on the prompts it keeps (text and ids): about 32 prompts
of a million tokens, 250 of 131K."""


def markers_of(tokenizer: Any) -> dict[str, int]:
    """The tokenizer's markers (see the module docstring): content -> id.
    Empty for a tokenizer that is not a fast Hugging Face one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not getattr(tokenizer, "is_fast", True):
        return {}
    added = {tok.content: (tok_id, tok) for tok_id, tok in backend.get_added_tokens_decoder().items()}
    contents = list(added)
    markers = {}
    for content, (tok_id, tok) in added.items():
        if not tok.special or tok.normalized or tok.lstrip or tok.rstrip or tok.single_word or not content:
            continue
        if not any(_overlap(content, other) for other in contents if other != content):
            markers[content] = tok_id
    return markers


def _overlap(a: str, b: str) -> bool:
    """Whether an occurrence of `b` can share a character with one of `a`."""
    if a in b or b in a:
        return True
    return any(a.endswith(b[:n]) or b.endswith(a[:n]) for n in range(1, min(len(a), len(b))))


@dataclass
class _Prompt:
    """A kept prompt: its text, its ids and its markers' character spans and
    token indices, in order."""

    text: str
    ids: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    token_at: np.ndarray

    @property
    def nbytes(self) -> int:
        return sys.getsizeof(self.text) + self.ids.nbytes + 3 * self.starts.nbytes


class PromptTokenCache:
    """Token ids of recent long prompts, re-used for prompts that extend them."""

    def __init__(self, tokenize: Callable[[str], list[int]], markers: dict[str, int], *,
                 min_chars: int = MIN_CHARS, max_bytes: int = MAX_BYTES,
                 on_reuse: Callable[[int], None] | None = None):
        """`tokenize(text)`: the tokenizer's ids of `text` without added
        special tokens; `markers` from `markers_of` that tokenizer;
        `on_reuse(n)` is told of every prompt that took `n` tokens from a
        kept one."""
        if not markers:
            raise ValueError("PromptTokenCache needs at least one marker token")
        self._tokenize = tokenize
        self.min_chars, self.max_bytes = min_chars, max_bytes
        self._ids_of = markers
        self._marker_ids = np.fromiter(markers.values(), dtype=np.int32)
        self._pattern = re.compile("|".join(map(re.escape, sorted(markers, key=len, reverse=True))))
        self._prompts: OrderedDict[int, _Prompt] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._on_reuse = on_reuse

    def __len__(self) -> int:
        return len(self._prompts)

    @property
    def kept_bytes(self) -> int:
        return self._bytes

    def encode(self, text: str) -> list[int]:
        """`tokenize(text)`, from a kept prompt's ids wherever one shares a
        marker-ended prefix."""
        if len(text) < self.min_chars:
            return self._tokenize(text)
        with self._lock:
            base, marker = self._longest_reusable(text)
        if base is None:
            ids = np.asarray(self._tokenize(text), dtype=np.int32)
            self._keep(self._indexed(text, ids, 0, 0), replaces=None)
            return ids.tolist()
        cut, j = int(base.starts[marker]), int(base.token_at[marker])
        tail = np.asarray(self._tokenize(text[cut:]), dtype=np.int32)
        ids = np.concatenate([base.ids[:j], tail])
        prompt = self._indexed(text, ids, cut, j, head=base, head_markers=marker)
        self._keep(prompt, replaces=base)
        if self._on_reuse is not None:
            self._on_reuse(j)
        return ids.tolist()

    def _longest_reusable(self, text: str) -> tuple[_Prompt | None, int]:
        """The kept prompt sharing the longest marker-ended prefix with `text`
        and the index of the marker it ends at, or (None, -1)."""
        best, best_marker, best_end = None, -1, 0
        for prompt in reversed(self._prompts.values()):
            if len(prompt.ends) == 0 or prompt.ends[-1] <= best_end:
                continue
            shared = _shared_prefix(text, prompt.text, int(prompt.ends[-1]))
            marker = int(np.searchsorted(prompt.ends, shared, side="right")) - 1
            if marker >= 0 and prompt.starts[marker] > 0 and prompt.ends[marker] > best_end:
                best, best_marker, best_end = prompt, marker, int(prompt.ends[marker])
        return best, best_marker

    def _indexed(self, text: str, ids: np.ndarray, cut: int, j: int, head: _Prompt | None = None,
                 head_markers: int = 0) -> _Prompt | None:
        """`text` with its markers indexed: those of `head` before its marker
        `head_markers` as they are, those from character `cut` (token `j`) on
        found again. None when the markers and marker tokens do not pair up."""
        found = [(m.start(), m.end(), self._ids_of[m.group()]) for m in self._pattern.finditer(text, cut)]
        spans = np.asarray(found, dtype=np.int64).reshape(-1, 3)
        at = j + np.flatnonzero(np.isin(ids[j:], self._marker_ids))
        if len(at) != len(spans) or not np.array_equal(ids[at], spans[:, 2]):
            return None
        starts, ends = spans[:, 0], spans[:, 1]
        if head is not None:
            starts = np.concatenate([head.starts[:head_markers], starts])
            ends = np.concatenate([head.ends[:head_markers], ends])
            at = np.concatenate([head.token_at[:head_markers], at])
        return _Prompt(text, ids, starts, ends, at)

    def _keep(self, prompt: _Prompt | None, replaces: _Prompt | None) -> None:
        """Keep `prompt` (most recent last); drop the prompt it extends (the
        agent's next step extends the new one) and the oldest beyond the bound."""
        if prompt is None or prompt.nbytes > self.max_bytes:
            return
        with self._lock:
            if replaces is not None and self._prompts.pop(id(replaces), None) is not None:
                self._bytes -= replaces.nbytes
            self._prompts[id(prompt)] = prompt
            self._bytes += prompt.nbytes
            while self._bytes > self.max_bytes:
                _, oldest = self._prompts.popitem(last=False)
                self._bytes -= oldest.nbytes


def _shared_prefix(a: str, b: str, limit: int) -> int:
    """The length of the longest common prefix of `a` and `b`, at most `limit`."""
    hi = min(len(a), len(b), limit)
    if a.startswith(b[:hi]):
        return hi
    lo = 0  # a[:lo] == b[:lo]; a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a.startswith(b[lo:mid], lo):
            lo = mid
        else:
            hi = mid
    return lo


_PLAIN_KEYWORDS = {"add_special_tokens", "truncation", "max_length", "padding", "return_tensors"}


def reuse_prompt_tokens(tokenizer: Any, **kwargs: Any) -> PromptTokenCache | None:
    """Make `tokenizer` (this object, and copies made of it from now on)
    encode long single texts through a `PromptTokenCache` where it is called
    as vLLM's renderer calls it: `tokenizer(text, add_special_tokens=False,
    truncation=..., max_length=...)` (the rendered chat prompt; also what
    `apply_chat_template(tokenize=True)` calls). The ids are the same; a
    result longer than `max_length` under truncation, and every other call,
    goes to the tokenizer as before. As vLLM wraps its tokenizers, by giving
    the object a subclass of its class. Returns the cache, or None (and
    changes nothing) for a tokenizer it cannot serve exactly."""
    from transformers import BatchEncoding

    base = type(tokenizer)
    if set(getattr(tokenizer, "model_input_names", ())) - {"input_ids", "attention_mask"}:
        return None
    markers = markers_of(tokenizer)
    if not markers:
        return None
    cache = PromptTokenCache(lambda text: base.__call__(tokenizer, text, add_special_tokens=False)["input_ids"],
                             markers, **kwargs)

    class PromptReusingTokenizer(base):  # type: ignore[misc, valid-type]
        def __call__(self, text: Any = None, *args: Any, **kw: Any) -> Any:
            if isinstance(text, str) and len(text) >= cache.min_chars and not args and _plain(kw):
                ids = cache.encode(text)
                if len(ids) <= _truncated_at(self, kw):
                    return BatchEncoding({"input_ids": ids, "attention_mask": [1] * len(ids)})
            return super().__call__(text, *args, **kw)

    PromptReusingTokenizer.__name__ = f"PromptReusing{base.__name__}"
    tokenizer.__class__ = PromptReusingTokenizer
    return cache


def _plain(kw: dict[str, Any]) -> bool:
    """Whether a call's keywords are those vLLM tokenizes a prompt with."""
    return (kw.get("add_special_tokens", True) is False and kw.get("truncation") in (None, False, True)
            and kw.get("padding") in (None, False, "do_not_pad") and kw.get("return_tensors") is None
            and set(kw) <= _PLAIN_KEYWORDS)


def _truncated_at(tokenizer: Any, kw: dict[str, Any]) -> float:
    """The length beyond which the call's keywords truncate (Hugging Face's
    rules: `max_length` alone truncates too; `truncation=True` alone, at the
    tokenizer's `model_max_length`)."""
    truncation, max_length = kw.get("truncation"), kw.get("max_length")
    if truncation is False or (truncation is None and max_length is None):
        return float("inf")
    return max_length if max_length is not None else tokenizer.model_max_length
