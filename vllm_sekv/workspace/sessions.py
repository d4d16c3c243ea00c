"""Session workspaces: each agent session's history as an ordered list of blocks.

A session is named by the client's `session_id` within its `cache_salt`
(tenants never see each other's sessions). Salts are kept only as digests, so
a tenant's salt is never written to disk. A workspace is the list of block
hashes of the last history the session sent. A new step whose history
diverges from it at block d *forks* the workspace there: the session now names
the new history; blocks past d stay in the catalog under their own hashes
(other sessions may share them) until evicted. Since a block's hash covers its
whole prefix, two histories can never mix blocks.

Session ids come from clients and may be anything (empty, huge, any unicode);
they are only ever dictionary keys and JSON strings, never paths.

Single-threaded: owned by the scheduler-side connector.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from vllm_sekv.workspace.hashing import root_hash


def salt_digest(salt: str) -> str:
    return root_hash(salt).hex()


@dataclass
class Workspace:
    salt_digest: str
    session_id: str
    block_hashes: list[bytes] = field(default_factory=list)
    num_tokens: int = 0
    num_forks: int = 0
    last_used_s: float = field(default_factory=time.time)


class SessionTable:
    def __init__(self) -> None:
        self._workspaces: dict[tuple[str, str], Workspace] = {}
        self.dirty = False  # changed since the manifest was last written

    def __len__(self) -> int:
        return len(self._workspaces)

    def __iter__(self):
        return iter(list(self._workspaces.values()))

    def get(self, salt: str, session_id: str) -> Workspace | None:
        return self._workspaces.get((salt_digest(salt), session_id))

    def add(self, ws: Workspace) -> None:
        self._workspaces[(ws.salt_digest, ws.session_id)] = ws

    def record(self, salt: str, session_id: str, hashes: list[bytes], num_tokens: int) -> Workspace:
        """Make `hashes` the session's history, forking where it diverges."""
        key = (salt_digest(salt), session_id)
        ws = self._workspaces.get(key)
        if ws is None:
            ws = self._workspaces[key] = Workspace(*key)
        elif _common_prefix(ws.block_hashes, hashes) < len(ws.block_hashes):
            ws.num_forks += 1
        ws.block_hashes = list(hashes)
        ws.num_tokens = num_tokens
        ws.last_used_s = time.time()
        self.dirty = True
        return ws

    def delete(self, salt_digest_hex: str, session_id: str) -> Workspace | None:
        ws = self._workspaces.pop((salt_digest_hex, session_id), None)
        self.dirty = self.dirty or ws is not None
        return ws


def _common_prefix(a: list[bytes], b: list[bytes]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
