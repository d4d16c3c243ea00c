"""The on-disk record of one workspace block: a 4 KiB header, then its bytes.

Header (little-endian), then zeros to 4 KiB:

    magic "SEKVBLK2", format version
    block hash (16 B), tenant key (16 B), model fingerprint digest (32 B)
    start token (its virtual position), block tokens, layers, KV heads,
    head dim, dtype code, codec code, rank, payload bytes
    checksum kind, checksum         over the identity above and the payload
    header CRC32                    over every byte before it
    surprisal count, its CRC32, float32 values (SeKV; optional metadata)

Codec: `CODEC_EXACT` (the slot's bytes in the model dtype) or `CODEC_FP8`
(`workspace_codec` fp8: the slot's e4m3 bytes, then its float32 scales). A
reader of another codec rejects the header ("another layout, codec or
rank"): fp8 blocks are never read as exact ones, nor the reverse.

The checksum covers the whole identity (what the block is, whose it is, which
model wrote it, where it sits, how it is laid out) together with the payload,
so a record read back is served only if all of it is what the reader expects
and intact. It is XXH3-64 (CRC32 without the `xxhash` package): it detects
damage (torn writes, bit rot, a record copied under another name), not
tampering; the folder is owner-only (`store.nvme`), and a writer with the
owner's rights could change the weights too. The header CRC lets the
start-up scan reject a damaged header without reading the payload. The
surprisal values carry their own CRC: a damaged copy makes them unknown, it
never fails the read.

Pure functions and small dataclasses; no I/O.
"""
from __future__ import annotations

import hashlib
import json
import struct
import zlib
from dataclasses import dataclass

import numpy as np
import torch

MAGIC = b"SEKVBLK2"
FORMAT_VERSION = 2
HEADER_BYTES = 4096
ALIGN_BYTES = 4096
_IDENTITY = struct.Struct("<8sI16s16s32sqIIIIIIiq")
TENANT_OFFSET = 8 + 4 + 16  # where the tenant key sits: after magic, version and block hash
_CHECK = struct.Struct("<IQ")
_CRC = struct.Struct("<I")
_SURPRISAL = struct.Struct("<II")
SURPRISAL_AT = _IDENTITY.size + _CHECK.size + _CRC.size
MAX_SURPRISAL_TOKENS = (HEADER_BYTES - SURPRISAL_AT - _SURPRISAL.size) // 4
CHECKSUM_CRC32, CHECKSUM_XXH3 = 1, 2
DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3, torch.float8_e4m3fn: 4,
               torch.float8_e5m2: 5, torch.uint8: 6}
CODEC_EXACT = 0
# `workspace_codec` fp8: the payload is the slot's float8 e4m3 K/V, then its
# float32 parameters `[2, layers, kv_heads, 1 + head_dim]` (`store.fp8`); dtype is the model's.
# Code 1 is retired: its records hold scales without centres and are never read.
CODEC_FP8 = 2
_CODEC_CODES = {"exact": CODEC_EXACT, "fp8": CODEC_FP8}


def codec_code(workspace_codec: str) -> int:
    """The header's codec code of a `workspace_codec`."""
    return _CODEC_CODES[workspace_codec]


class RecordError(ValueError):
    """A record (or its header) that must not be served."""


def record_bytes(payload_bytes: int) -> int:
    return HEADER_BYTES + -(-payload_bytes // ALIGN_BYTES) * ALIGN_BYTES


def fingerprint_digest(fingerprint: dict) -> bytes:
    """32 bytes that name a model fingerprint (`model_identity.model_fingerprint`)."""
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).digest()


@dataclass(frozen=True)
class RecordLayout:
    """What every record of one folder and rank must say about itself."""

    fingerprint: bytes  # `fingerprint_digest` of the model that wrote it
    block_tokens: int
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    rank: int
    payload_bytes: int
    codec: int = CODEC_EXACT

    @classmethod
    def of_pool(cls, fingerprint: bytes, pool_data: torch.Tensor, rank: int,
                pool_scales: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> "RecordLayout":
        """The layout of a host pool's slots (`[slots, 2, layers, tokens, heads, dim]`);
        with `pool_scales` (an fp8 pool's, `HostPool.scales`) an fp8 record
        of model dtype `dtype`."""
        _, _, layers, tokens, heads, dim = pool_data.shape
        payload = pool_data[0].numel() * pool_data.element_size()
        if pool_scales is None:
            return cls(fingerprint, tokens, layers, heads, dim, pool_data.dtype, rank, payload)
        payload += pool_scales[0].numel() * pool_scales.element_size()
        return cls(fingerprint, tokens, layers, heads, dim, dtype, rank, payload, CODEC_FP8)


@dataclass(frozen=True)
class RecordHeader:
    block_hash: bytes
    tenant: bytes  # 16 bytes: the tenant key (`workspace.tenants`)
    start_token: int
    layout: RecordLayout
    checksum_kind: int
    checksum: int


def checksum_kind() -> int:
    """XXH3 when the `xxhash` package is there, else CRC32."""
    try:
        import xxhash  # noqa: F401

        return CHECKSUM_XXH3
    except ImportError:
        return CHECKSUM_CRC32


def checksum(kind: int, identity: bytes, payload) -> int:
    if kind == CHECKSUM_XXH3:
        import xxhash

        h = xxhash.xxh3_64()
        h.update(identity)
        h.update(payload)
        return h.intdigest()
    if kind == CHECKSUM_CRC32:
        return zlib.crc32(payload, zlib.crc32(identity))
    raise RecordError(f"unknown checksum kind {kind}")


def _identity(block_hash: bytes, tenant: bytes, start_token: int, layout: RecordLayout) -> bytes:
    return _IDENTITY.pack(MAGIC, FORMAT_VERSION, block_hash, tenant, layout.fingerprint, start_token,
                          layout.block_tokens, layout.num_layers, layout.kv_heads, layout.head_dim,
                          DTYPE_CODES.get(layout.dtype, 0), layout.codec, layout.rank, layout.payload_bytes)


def pack_header(block_hash: bytes, tenant: bytes, start_token: int, layout: RecordLayout, payload,
                kind: int, surprisal: np.ndarray | None = None) -> bytes:
    """The record's 4 KiB header for `payload` (its checksum computed here)."""
    identity = _identity(block_hash, tenant, start_token, layout)
    head = identity + _CHECK.pack(kind, checksum(kind, identity, payload))
    head += _CRC.pack(zlib.crc32(head)) + _pack_surprisal(surprisal)
    return head.ljust(HEADER_BYTES, b"\0")


def unpack_header(header: bytes | memoryview, layout: RecordLayout) -> RecordHeader:
    """A header's fields, checked against `layout` (everything but the
    checksum, which needs the payload: `verify`). Raises RecordError."""
    if len(header) < SURPRISAL_AT:
        raise RecordError("short header")
    head = bytes(header[:SURPRISAL_AT])
    (crc,) = _CRC.unpack_from(head, _IDENTITY.size + _CHECK.size)
    if zlib.crc32(head[: _IDENTITY.size + _CHECK.size]) != crc:
        raise RecordError("damaged header")
    (magic, version, block_hash, tenant, fingerprint, start, tokens, layers, heads, dim, dtype, codec, rank,
     payload) = _IDENTITY.unpack_from(head, 0)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise RecordError(f"not a version-{FORMAT_VERSION} record")
    if fingerprint != layout.fingerprint:
        raise RecordError("written by another model")
    if (tokens, layers, heads, dim, dtype, codec, rank, payload) != (
            layout.block_tokens, layout.num_layers, layout.kv_heads, layout.head_dim,
            DTYPE_CODES.get(layout.dtype, 0), layout.codec, layout.rank, layout.payload_bytes):
        raise RecordError("another layout, codec or rank")
    kind, value = _CHECK.unpack_from(head, _IDENTITY.size)
    return RecordHeader(block_hash, tenant, start, layout, kind, value)


def verify(header: RecordHeader, payload) -> None:
    """Raise RecordError unless the payload and the header's identity match its checksum."""
    identity = _identity(header.block_hash, header.tenant, header.start_token, header.layout)
    if checksum(header.checksum_kind, identity, payload) != header.checksum:
        raise RecordError("checksum mismatch")


def _pack_surprisal(surprisal: np.ndarray | None) -> bytes:
    if surprisal is None or not len(surprisal):
        return _SURPRISAL.pack(0, 0)
    values = np.ascontiguousarray(surprisal, dtype=np.float32)[:MAX_SURPRISAL_TOKENS].tobytes()
    return _SURPRISAL.pack(len(values) // 4, zlib.crc32(values)) + values


def unpack_surprisal(header) -> np.ndarray | None:
    """The header's surprisal, or None (absent, or its CRC does not match)."""
    count, crc = _SURPRISAL.unpack_from(header, SURPRISAL_AT)
    if not 0 < count <= MAX_SURPRISAL_TOKENS:
        return None
    start = SURPRISAL_AT + _SURPRISAL.size
    values = bytes(header[start : start + 4 * count])
    if zlib.crc32(values) != crc:
        return None
    return np.frombuffer(values, dtype=np.float32).copy()
