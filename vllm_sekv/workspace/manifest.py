"""The manifest: a restarted server's (and the `vllm-sekv sessions` command's)
list of session workspaces in an NVMe folder.

JSON with a format version, written atomically (temporary file + rename), so a
crash leaves the previous manifest intact. Blocks themselves are found by
scanning the folder (each record is self-describing and checksummed); the
manifest only names sessions and their block lists. A manifest that cannot be
read is reported and ignored: workspaces are still restorable by content.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from vllm_sekv.workspace.sessions import SessionTable, Workspace

FORMAT_VERSION = 1


class ManifestError(ValueError):
    pass


def write_manifest(path: Path, sessions: SessionTable, fingerprint: dict) -> None:
    data = {
        "format_version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "sessions": [
            {
                "salt_digest": ws.salt_digest,
                "session_id": ws.session_id,
                "num_tokens": ws.num_tokens,
                "num_forks": ws.num_forks,
                "last_used_s": ws.last_used_s,
                "block_hashes": [h.hex() for h in ws.block_hashes],
            }
            for ws in sessions
        ],
    }
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, ensure_ascii=True))
    os.replace(tmp, path)


def read_manifest(path: Path) -> tuple[dict, list[Workspace]]:
    """(fingerprint, workspaces). Raises ManifestError on anything unreadable."""
    try:
        data = json.loads(path.read_text())
        if data.get("format_version") != FORMAT_VERSION:
            raise ManifestError(
                f"{path}: format version {data.get('format_version')!r}, expected {FORMAT_VERSION}"
            )
        workspaces = [
            Workspace(
                salt_digest=str(s["salt_digest"]),
                session_id=str(s["session_id"]),
                block_hashes=[bytes.fromhex(h) for h in s["block_hashes"]],
                num_tokens=int(s["num_tokens"]),
                num_forks=int(s.get("num_forks", 0)),
                last_used_s=float(s["last_used_s"]),
            )
            for s in data["sessions"]
        ]
        return dict(data.get("fingerprint", {})), workspaces
    except (OSError, ValueError, KeyError, TypeError) as e:
        if isinstance(e, ManifestError):
            raise
        raise ManifestError(f"{path}: {e}") from e
