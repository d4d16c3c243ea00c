"""Tenants: clients' cache salts, known to the workspace only by keyed digests.

A client's `cache_salt` names its tenant. The workspace never keeps a salt:
the scheduler side turns it into a *tenant key*, a BLAKE2b-128 MAC of the
salt under a server secret, and every structure below works with tenant keys
(block-hash chains start from one, sessions are keyed by one, NVMe records
carry one). Whoever reads the disk or the shared tier learns no salt and
cannot confirm a guessed prompt for a tenant offline without the secret.

The secret (`hash_secret`, resolved by `resolve_secret`): the configured
value, else a random one kept in the NVMe folder (owner-only, so a restarted
server finds its workspaces again), else a random one per process (a host
tier dies with its server anyway). Servers that share a tier must share it.

Pure, no vLLM imports; `TenantKeys` is not thread-safe (scheduler thread).
"""
from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

SECRET_FILE = "secret"
_PERSON = b"sekv-tenant-v2"


class TenantKeys:
    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise ValueError("sekv config 'hash_secret': at least 16 bytes are needed")
        self._key = hashlib.blake2b(secret, digest_size=32).digest()
        self._memo: dict[str, str] = {}

    def session_digest(self, tenant: str, session_id: str) -> str:
        """A keyed digest of one tenant's session id (what a shared store keeps)."""
        return hashlib.blake2b(f"{tenant}\x00{session_id}".encode("utf-8"), key=self._key,
                               person=b"sekv-session-v2", digest_size=16).hexdigest()

    def of(self, salt: str) -> str:
        """The tenant key of a client's cache salt (hex, 32 characters)."""
        key = self._memo.get(salt)
        if key is None:
            key = hashlib.blake2b(salt.encode("utf-8"), key=self._key, person=_PERSON, digest_size=16).hexdigest()
            if len(self._memo) >= 4096:
                self._memo.clear()
            self._memo[salt] = key
        return key


def tenant_bytes(tenant: str) -> bytes:
    """The 16 bytes a record keeps of a tenant key (any other string, as
    tests use, is digested to 16 bytes)."""
    if len(tenant) == 32:
        try:
            return bytes.fromhex(tenant)
        except ValueError:
            pass
    return hashlib.blake2b(tenant.encode("utf-8"), digest_size=16).digest()


def resolve_secret(configured: str, nvme_dir: str | Path | None) -> bytes:
    """The server secret: `configured` if set, else the NVMe folder's secret
    file (created owner-only with 32 random bytes when missing), else random
    bytes for this process. Raises OSError if the file cannot be read or made."""
    if configured:
        return configured.encode("utf-8")
    if not nvme_dir:
        return secrets.token_bytes(32)
    path = Path(nvme_dir) / SECRET_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_secret(path)
    try:
        os.write(fd, secrets.token_hex(32).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return read_secret(path)


def read_secret(path: Path) -> bytes:
    """A secret file's contents; one readable by others is made owner-only first."""
    if path.stat().st_mode & 0o077:
        os.chmod(path, 0o600)
    data = path.read_bytes().strip()
    if len(data) < 16:
        raise OSError(f"{path} holds no valid secret")
    return data
