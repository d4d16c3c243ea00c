"""Session workspaces: each agent session's history as an ordered list of blocks.

A session is named by the client's `session_id` within its `cache_salt`
(tenants never see each other's sessions). Its workspace is the list of block
hashes of the last history it sent. A new step whose history diverges from it
at block d *forks* the workspace there: the session now names the new history;
blocks past d stay in the catalog under their own hashes (other sessions may
share them) until evicted. Since a block's hash covers its whole prefix, two
histories can never mix blocks.

Single-threaded: owned by the scheduler-side connector.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Workspace:
    salt: str
    session_id: str
    block_hashes: list[bytes] = field(default_factory=list)
    num_tokens: int = 0
    num_forks: int = 0
    last_used_s: float = field(default_factory=time.time)


class SessionTable:
    def __init__(self) -> None:
        self._workspaces: dict[tuple[str, str], Workspace] = {}

    def __len__(self) -> int:
        return len(self._workspaces)

    def get(self, salt: str, session_id: str) -> Workspace | None:
        return self._workspaces.get((salt, session_id))

    def common_prefix_blocks(self, salt: str, session_id: str, hashes: list[bytes]) -> int:
        """Leading blocks that `hashes` shares with the session's workspace."""
        ws = self.get(salt, session_id)
        if ws is None:
            return 0
        n = 0
        for mine, theirs in zip(ws.block_hashes, hashes):
            if mine != theirs:
                break
            n += 1
        return n

    def record(self, salt: str, session_id: str, hashes: list[bytes], num_tokens: int) -> Workspace:
        """Make `hashes` the session's history, forking where it diverges."""
        ws = self._workspaces.get((salt, session_id))
        if ws is None:
            ws = self._workspaces[(salt, session_id)] = Workspace(salt, session_id)
        elif self.common_prefix_blocks(salt, session_id, hashes) < len(ws.block_hashes):
            ws.num_forks += 1
        ws.block_hashes = list(hashes)
        ws.num_tokens = num_tokens
        ws.last_used_s = time.time()
        return ws

    def delete(self, salt: str, session_id: str) -> bool:
        return self._workspaces.pop((salt, session_id), None) is not None
