"""Session workspaces: each agent session's history as an ordered list of blocks.

A session is named by the client's `session_id` within its tenant (the
keyed digest of its `cache_salt`, `workspace.tenants`): tenants never see
each other's sessions, and no salt is ever kept. A workspace is the list of block
hashes of the last history the session sent. A new step whose history
diverges from it at block d *forks* the workspace there: the session now names
the new history; blocks past d stay in the catalog under their own hashes
(other sessions may share them) until evicted. Since a block's hash covers its
whole prefix, two histories can never mix blocks.

Session ids come from clients (checked at the API: a non-empty string of at
most 256 characters, `request_params`); they are only ever dictionary keys and
manifest fields, never paths. The table is bounded (`max_sessions`).

Single-threaded: owned by the scheduler-side connector.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from vllm_sekv.workspace.hashing import shared_blocks


@dataclass
class Workspace:
    tenant: str  # tenant key (`TenantKeys.of` of the client's cache salt)
    session_id: str
    block_hashes: list[bytes] = field(default_factory=list)
    num_tokens: int = 0
    num_forks: int = 0
    last_used_s: float = field(default_factory=time.time)
    # Blocks of the histories this session forked away from (at most
    # `SessionTable.max_forked_blocks`): deleting the session deletes them too.
    forked: set[bytes] = field(default_factory=set)


class SessionTable:
    """The named sessions, least recently used first; at most `max_sessions`
    (the least recently used beyond that are dropped: their blocks stay
    restorable by content, the name is forgotten; `take_evicted` lists them)."""

    def __init__(self, max_sessions: int = 100_000, max_forked_blocks: int = 1 << 16) -> None:
        self.max_sessions = max_sessions
        self.max_forked_blocks = max_forked_blocks
        self._workspaces: OrderedDict[tuple[str, str], Workspace] = OrderedDict()
        self._evicted: list[Workspace] = []

    def __len__(self) -> int:
        return len(self._workspaces)

    def __iter__(self):
        return iter(list(self._workspaces.values()))

    def get(self, tenant: str, session_id: str) -> Workspace | None:
        return self._workspaces.get((tenant, session_id))

    def add(self, ws: Workspace) -> None:
        self._workspaces[(ws.tenant, ws.session_id)] = ws
        self._workspaces.move_to_end((ws.tenant, ws.session_id))
        self._evict()

    def record(self, tenant: str, session_id: str, hashes: list[bytes], num_tokens: int) -> Workspace:
        """Make `hashes` the session's history, forking where it diverges."""
        key = (tenant, session_id)
        ws = self._workspaces.get(key)
        if ws is None:
            ws = self._workspaces[key] = Workspace(*key)
        else:
            shared = _common_prefix(ws.block_hashes, hashes)
            if shared < len(ws.block_hashes):
                ws.num_forks += 1
                room = self.max_forked_blocks - len(ws.forked)
                ws.forked.update(ws.block_hashes[shared : shared + max(room, 0)])
            if ws.forked:
                ws.forked.difference_update(hashes)
        ws.block_hashes = list(hashes)
        ws.num_tokens = num_tokens
        ws.last_used_s = time.time()
        self._workspaces.move_to_end(key)
        self._evict()
        return ws

    def delete(self, tenant: str, session_id: str) -> Workspace | None:
        return self._workspaces.pop((tenant, session_id), None)

    def take_evicted(self) -> list[Workspace]:
        out, self._evicted = self._evicted, []
        return out

    def _evict(self) -> None:
        while len(self._workspaces) > self.max_sessions:
            self._evicted.append(self._workspaces.popitem(last=False)[1])


def _common_prefix(a: list[bytes], b: list[bytes]) -> int:
    """How many leading hashes `a` and `b` share (a grown history: one list comparison)."""
    return shared_blocks(a, b, min(len(a), len(b)), 1)
