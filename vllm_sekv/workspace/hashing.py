"""Content addresses of workspace blocks.

Block j of a token sequence is named by a chained hash over the salt and all
tokens up to the end of block j: two sequences share block j exactly when they
share every token before its end and the salt. The salt is the request's
`cache_salt`, so tenants with different salts never share a block. Hashes are
BLAKE2b-128, stable across processes and restarts.
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

_VERSION = b"sekv-block-v1"


def root_hash(salt: str) -> bytes:
    return hashlib.blake2b(_VERSION + salt.encode("utf-8"), digest_size=16).digest()


def extend_block_hashes(
    hashes: list[bytes], token_ids: Sequence[int], block_tokens: int, salt: str
) -> list[bytes]:
    """Append the hashes of every full block of `token_ids` not yet in `hashes`.

    `hashes` holds the hashes of the first len(hashes) blocks of the same
    sequence (possibly none); it is extended in place and returned.
    """
    parent = hashes[-1] if hashes else root_hash(salt)
    for start in range(len(hashes) * block_tokens, len(token_ids) - block_tokens + 1, block_tokens):
        chunk = array("q", token_ids[start : start + block_tokens]).tobytes()
        parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
        hashes.append(parent)
    return hashes
