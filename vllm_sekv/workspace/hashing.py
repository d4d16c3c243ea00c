"""Content addresses of workspace blocks.

Block j of a token sequence is named by a chained hash over the request's
tenant key and all tokens up to the end of block j: two sequences share block
j exactly when they share every token before its end and the tenant. The
tenant key is a keyed digest of the client's `cache_salt`
(`workspace.tenants`), so tenants never share a block and the chain cannot be
recomputed without the server secret. Hashes are BLAKE2b-128, stable across
processes and restarts (with the same secret).
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

_VERSION = b"sekv-block-v2"


def root_hash(tenant: str) -> bytes:
    return hashlib.blake2b(_VERSION + tenant.encode("utf-8"), digest_size=16).digest()


def extend_block_hashes(
    hashes: list[bytes], token_ids: Sequence[int], block_tokens: int, tenant: str, end: int | None = None
) -> list[bytes]:
    """Append the hashes of every full block of `token_ids[:end]` not yet in `hashes`.

    `hashes` holds the hashes of the first len(hashes) blocks of the same
    sequence (possibly none); it is extended in place and returned. Only
    the new blocks' tokens are read (`end` spares the caller a copy).
    """
    parent = hashes[-1] if hashes else root_hash(tenant)
    end = len(token_ids) if end is None else min(end, len(token_ids))
    for start in range(len(hashes) * block_tokens, end - block_tokens + 1, block_tokens):
        chunk = array("q", token_ids[start : start + block_tokens]).tobytes()
        parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
        hashes.append(parent)
    return hashes


class JoinedTokens(Sequence[int]):
    """`head + tail` as one read-only sequence, without copying either.

    A view job's full history is its prompt (512K tokens and more) followed
    by what it generated, asked for at every new block (its hash) and at the
    end. Building that list each time costs about a millisecond at 512K;
    block hashing reads only the length and the slices of new blocks. Slices
    are lists; the parts are read when indexed (a `tail` that grows, like
    vLLM's `output_token_ids`, shows its new tokens)."""

    __slots__ = ("head", "tail")

    def __init__(self, head: Sequence[int], tail: Sequence[int]) -> None:
        self.head, self.tail = head, tail

    def __len__(self) -> int:
        return len(self.head) + len(self.tail)

    def __iter__(self):
        yield from self.head
        yield from self.tail

    def __getitem__(self, index):
        h = len(self.head)
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            if stop <= h:
                return list(self.head[start:stop])
            if start >= h:
                return list(self.tail[start - h:stop - h])
            return list(self.head[start:h]) + list(self.tail[:stop - h])
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("JoinedTokens index out of range")
        return self.head[index] if index < h else self.tail[index - h]


def shared_blocks(old: list[int], new: list[int], n: int, block_tokens: int) -> int:
    """How many whole blocks the first `n` tokens of `old` and `new` share
    (`n`: a multiple of `block_tokens`, at most either length). The usual
    case (the prompt grew) costs one list comparison; a prompt that differs
    somewhere (a new question after the same history, an edit) a binary
    search whose comparisons halve, about two more in all."""
    if n == 0 or (old[n - 1] == new[n - 1]
                  and (old if len(old) == n else old[:n]) == (new if len(new) == n else new[:n])):
        return n // block_tokens  # a whole list compares without a copy: at 1M tokens a copy is ~3 ms
    lo, hi = 0, n // block_tokens  # the first lo blocks are shared, the first hi are not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        a, b = lo * block_tokens, mid * block_tokens
        if old[a:b] == new[a:b]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixHashMemo:
    """The block hashes of recently hashed token sequences, reused for a new
    sequence that begins with one of them.

    An agent resends its whole history every step: hashing a long prompt
    again costs far more than comparing it with the last one. The blocks the
    two share from the start are reused, whatever follows them. One entry per
    `(tenant, key)` (`key`: the session id, or None for a tenant's requests
    without one) holding at least one whole block, with a copy of the tokens
    (callers may rewrite theirs) and their hashes; the least recently used
    entries go once the entries hold more than `capacity_tokens` tokens or
    number more than `max_entries`.

    `hashes(...)` equals `extend_block_hashes([], token_ids, block_tokens, tenant)`
    in every case: hashes are reused only for whole blocks whose tokens are
    equal, under the same tenant, and a chained hash depends on nothing else.
    Not thread-safe; blocking.
    """

    def __init__(self, block_tokens: int, capacity_tokens: int = 1 << 22, max_entries: int = 4096) -> None:
        self.block_tokens = block_tokens
        self.capacity_tokens = capacity_tokens
        self.max_entries = max_entries
        self._entries: dict[tuple[str, str | None], tuple[list[int], list[bytes]]] = {}
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def hashes(self, token_ids: Sequence[int], tenant: str, key: str | None = None) -> list[bytes]:
        """The hashes of every full block of `token_ids` (a new list)."""
        bt = self.block_tokens
        full = len(token_ids) // bt * bt
        entry = self._entries.pop((tenant, key), None)
        out: list[bytes] = []
        kept = None  # the memo's own copy of the tokens: callers may rewrite their list
        if entry is not None and isinstance(token_ids, list):  # its tokens are whole blocks, one hash each
            self._tokens -= len(entry[0])
            old_tokens, old_hashes = entry
            shared = shared_blocks(old_tokens, token_ids, min(len(old_tokens), full), bt)
            out = old_hashes[:shared]
            if shared * bt == len(old_tokens):  # the sequence grew: extend the copy (at 1M tokens a new one is ~4 ms)
                kept = old_tokens
                kept.extend(token_ids[len(kept):full])
        elif entry is not None:  # other sequence types: no reuse
            self._tokens -= len(entry[0])
        extend_block_hashes(out, token_ids, bt, tenant)
        if 0 < full <= self.capacity_tokens:  # nothing to reuse without a whole block
            if kept is None:
                kept = token_ids[:full]
            self._entries[(tenant, key)] = (kept if isinstance(kept, list) else list(kept), out)
            self._tokens += full
            while self._tokens > self.capacity_tokens or len(self._entries) > self.max_entries:
                oldest = next(iter(self._entries))
                self._tokens -= len(self._entries.pop(oldest)[0])
        return list(out)
