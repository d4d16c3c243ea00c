"""The remote tier: workspace records in a store several servers share.

`RemoteStore` is the whole interface a shared store implements (batched; a
store that is down, slow or refuses raises `RemoteUnavailable`, never blocks
longer than its timeout):

    contains(keys) -> [bool]      get(keys) -> [bytes | None]
    put({key: value})             delete(keys)

`RedisStore` implements it on Redis (or Valkey) through redis-py: one
pipeline per batch, bounded connect and socket timeouts, values written with
an optional TTL. Several servers may point at one Redis; which blocks stay
there is the Redis operator's `maxmemory` and eviction policy (and the TTL).

`RemoteHealth` is the tier's circuit breaker: after a failure it answers
"down" for a back-off that doubles up to `max_backoff_s`, so a Redis that is
down or slow costs a request one timeout at most, not one per block.

Values are records in the NVMe tier's format (`store.records`): the
identity (block, tenant, model, position, layout) and a checksum over it and
the bytes; a reader serves nothing that fails either. Keys hold only content
hashes and keyed digests (`keys`), never a session id or a cache salt.
Thread-safe: redis-py's connection pool is; no vLLM imports.
"""
from __future__ import annotations

import threading
import time
from typing import Protocol
from urllib.parse import urlparse


class RemoteUnavailable(RuntimeError):
    """The shared store did not answer in time, refused, or is down."""


class RemoteStore(Protocol):
    def contains(self, keys: list[str]) -> list[bool]: ...
    def get(self, keys: list[str]) -> list[bytes | None]: ...
    def put(self, items: dict[str, bytes]) -> None: ...
    def delete(self, keys: list[str]) -> None: ...


def record_key(prefix: str, block_hash: bytes, rank: int) -> str:
    return f"{prefix}b:{block_hash.hex()}.r{rank}"


def session_key(prefix: str, tenant: str, session_digest: str) -> str:
    return f"{prefix}s:{tenant}:{session_digest}"


def check_url(url: str) -> None:
    """Raise ValueError naming `remote_url` unless it is a Redis URL."""
    parsed = urlparse(url)
    if parsed.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"sekv config 'remote_url': expected redis://host:port/db, rediss://... (TLS) or "
                         f"unix:///path/to/socket, got {url!r}")
    if parsed.scheme != "unix" and not parsed.hostname:
        raise ValueError(f"sekv config 'remote_url': {url!r} names no host")


class RedisStore:
    """`RemoteStore` on Redis. `timeout_s` bounds every call (connect and
    each socket operation); `ttl_s` > 0 expires values that long after
    their last write."""

    def __init__(self, url: str, timeout_s: float = 0.5, ttl_s: int = 0) -> None:
        import redis

        check_url(url)
        self.url = url
        self.ttl_s = ttl_s
        self._errors = (redis.RedisError, OSError)
        # Values are whole blocks (MiBs): read the socket in MiB chunks (redis-py's 64 KiB halves the rate).
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                            retry_on_timeout=False, health_check_interval=0,
                                            socket_read_size=1 << 20)

    def _call(self, fn):
        try:
            return fn()
        except self._errors as e:
            raise RemoteUnavailable(f"{type(e).__name__}: {e}") from None

    def contains(self, keys: list[str]) -> list[bool]:
        if not keys:
            return []

        def run():
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            return [bool(n) for n in pipe.execute()]

        return self._call(run)

    def get(self, keys: list[str]) -> list[bytes | None]:
        if not keys:
            return []
        return self._call(lambda: self._client.mget(keys))

    def put(self, items: dict[str, bytes]) -> None:
        if not items:
            return

        def run():
            pipe = self._client.pipeline(transaction=False)
            for key, value in items.items():
                pipe.set(key, value, ex=self.ttl_s or None)
            pipe.execute()

        self._call(run)

    def delete(self, keys: list[str]) -> None:
        if keys:
            self._call(lambda: self._client.delete(*keys))

    def close(self) -> None:
        self._client.close()


class RemoteHealth:
    """Whether to try the remote store now: after a failure, not for a
    back-off (doubling from `min_backoff_s` to `max_backoff_s`); a success
    resets it. Thread-safe."""

    def __init__(self, min_backoff_s: float = 0.5, max_backoff_s: float = 30.0) -> None:
        self.min_backoff_s, self.max_backoff_s = min_backoff_s, max_backoff_s
        self._lock = threading.Lock()
        self._until = 0.0
        self._backoff = 0.0

    def up(self) -> bool:
        return time.monotonic() >= self._until

    def failed(self) -> float:
        """Note a failure; the back-off it starts, in seconds."""
        with self._lock:
            self._backoff = min(max(self._backoff * 2, self.min_backoff_s), self.max_backoff_s)
            self._until = time.monotonic() + self._backoff
            return self._backoff

    def ok(self) -> None:
        with self._lock:
            self._backoff, self._until = 0.0, 0.0
