"""SeKV's `lowrank(r)` codec on the host tier: compressed copies of host blocks.

The host pool (`HostPool`) keeps exact blocks, keys post-RoPE at the token's
virtual position. This tier keeps, per committed block (one host slot), a
compressed copy that a restore with `restore_codec = lowrank(r)` moves instead
of the exact bytes:

* What is stored. The block is cut into *pieces*, runs of consecutive tokens
  `[lo, hi)` inside the block given by the caller (surprisal segments cut at
  block boundaries, or the whole block as one piece). For every layer and
  every piece, `LowRankCodec.encode` of the piece's **pre-RoPE** keys (the pool
  keys de-rotated by `-(start_token + offset)`, in float32, then cast to the
  pool dtype) and of its values: one `Encoded` per (layer, piece). A piece the
  codec would not shrink (`stores_exact`, e.g. fewer tokens than the rank) is
  stored exact, as copies (never views of the pool).
* What `decode_rows` returns. For host rows `slot * block_tokens + offset` and
  a target position per row: `(keys [L, n, H, D], values [L, n, H, D], bytes)`,
  rows in the given order, in the pool dtype, on `device`. Each needed
  (slot, piece) is decoded once per call on `device` (the codec moves the
  factors there first); keys are then rotated from pre-RoPE to the target
  positions in float32 and cast to the pool dtype. An exact piece gives the
  pool's values bit for bit, and keys equal to rotating the pool keys by
  `-(start_token + offset)` then by the target position the same way (float32,
  pool dtype in between).
* Bytes counted. `encoded_bytes(slot)` and the third result of `decode_rows`
  are `Codec.encoded_bytes` summed over the `Encoded`s involved (all of the
  slot's; every piece decoded in the call, each once, all layers): what a
  restore moves host -> device. `exact_bytes()` is one exact block's bytes.

The layout (layers, kv heads, head dim, dtype) is fixed by the first
`encode_block`; later pools must match it.

Runs in the worker process; every call is blocking, on the caller's thread,
and mutates only this tier (never the pool). Not thread-safe.
Failures raise `ValueError` naming the argument: a codec other than
`LowRankCodec`, a bad slot, start token or block size, pieces that are empty,
out of range, out of order or not covering the block exactly, a pool of another
layout, non-finite K/V in a factored piece (from the codec; the slot's earlier
encoding is then kept), rows/positions of bad shape or rows whose slot has no
encoding (the message names the slot).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from vllm_sekv.ops import RopeSpec, rotate_keys
from vllm_sekv.store.codecs import Encoded, LowRankCodec
from vllm_sekv.store.host_pool import HostPool

Piece = tuple[int, int]


@dataclass(frozen=True)
class _Layout:
    """What every encoded block of this tier shares."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype


@dataclass(frozen=True)
class _SlotCode:
    """One slot's encoding.

    start_token: virtual position of the block's token 0 (keys in the pool sat
        at `start_token + offset`).
    pieces: `[lo, hi)` token offsets, in order, covering the block.
    encoded: `encoded[layer][piece]`, pre-RoPE keys and values of that piece.
    piece_bytes: `piece_bytes[piece]`, encoded bytes of that piece, all layers.
    """

    start_token: int
    pieces: tuple[Piece, ...]
    encoded: tuple[tuple[Encoded, ...], ...]
    piece_bytes: tuple[int, ...]


class LowRankTier:
    """Per host slot, `lowrank(r)` factors of each piece's pre-RoPE keys and values;
    see the module docstring for the contract."""

    def __init__(self, codec: LowRankCodec, block_tokens: int, rope: RopeSpec) -> None:
        if not isinstance(codec, LowRankCodec):
            raise ValueError(f"codec must be a LowRankCodec, got {codec!r}")
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
            raise ValueError(f"block_tokens must be an int >= 1, got {block_tokens!r}")
        if not isinstance(rope, RopeSpec):
            raise ValueError(f"rope must be a RopeSpec, got {type(rope).__name__}")
        self.codec = codec
        self.block_tokens = block_tokens
        self.rope = rope
        self._layout: _Layout | None = None
        self._slots: dict[int, _SlotCode] = {}

    # ------------------------------------------------------------ encode / bookkeeping

    def encode_block(self, pool: HostPool, slot: int, start_token: int,
                     pieces: Sequence[tuple[int, int]] | None = None) -> None:
        """Encode slot `slot` of the pool (all layers; an fp8 pool's dequantized), whose keys sit at virtual positions
        `start_token + offset`, piece by piece; replaces any earlier encoding of `slot`.

        pieces: `[lo, hi)` token offsets inside the block, in order, covering
            `0..block_tokens` exactly; None = the whole block as one piece.
        """
        layout = self._check_pool(pool)
        slot = _as_int("slot", slot)
        if not 0 <= slot < pool.num_slots:
            raise ValueError(f"slot must be in [0, {pool.num_slots}), got {slot}")
        start_token = _as_int("start_token", start_token)
        if start_token < 0:
            raise ValueError(f"start_token must be >= 0, got {start_token}")
        checked = self._check_pieces(pieces)

        block = pool.data[slot] if pool.scales is None else pool.dequantized_slots([slot])[0]  # [2, L, T, H, D]
        keys_pre = self._derotate(block[0], start_token)             # [L, T, H, D] pool dtype, new
        values = block[1]                                            # [L, T, H, D] view of the pool
        encoded: list[tuple[Encoded, ...]] = []
        for layer in range(layout.num_layers):
            # Clones: an exact piece keeps references to what it is given.
            encoded.append(tuple(
                self.codec.encode(keys_pre[layer, lo:hi].clone(), values[layer, lo:hi].clone())
                for lo, hi in checked))
        piece_bytes = tuple(sum(self.codec.encoded_bytes(encoded[layer][p])
                                for layer in range(layout.num_layers))
                            for p in range(len(checked)))
        self._layout = layout
        self._slots[slot] = _SlotCode(start_token, checked, tuple(encoded), piece_bytes)

    def drop(self, slot: int) -> None:
        """Forget `slot`'s encoding (slot reused or evicted); nothing if it has none."""
        self._slots.pop(_as_int("slot", slot), None)

    def has(self, slot: int) -> bool:
        """True when `slot` has an encoding."""
        return _as_int("slot", slot) in self._slots

    def pieces_of(self, slot: int) -> tuple[Piece, ...] | None:
        """The pieces `slot` is encoded in, None when it has no encoding."""
        code = self._slots.get(_as_int("slot", slot))
        return None if code is None else code.pieces

    def encoded_bytes(self, slot: int) -> int:
        """Bytes of all of `slot`'s factors (exact pieces: their raw bytes), all
        layers: what a restore of the whole block moves."""
        return sum(self._code(slot).piece_bytes)

    def exact_bytes(self) -> int:
        """Bytes of one exact block (K and V, all layers), for ratios."""
        if self._layout is None:
            raise ValueError("no block encoded yet: the tier does not know the block layout")
        lay = self._layout
        return HostPool.bytes_per_block(lay.num_layers, self.block_tokens, lay.kv_heads,
                                        lay.head_dim, lay.dtype)

    # ------------------------------------------------------------ decode

    def decode_rows(self, rows: np.ndarray | torch.Tensor, positions: np.ndarray | torch.Tensor,
                    device: torch.device | str | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Rebuild host rows `slot * block_tokens + offset` from their encodings.

        rows, positions: `[n]` integers (numpy or torch, any device: read on the host);
            `positions[i]` is the position row i's key is rotated to.
        Returns (keys `[L, n, H, D]` post-RoPE at `positions`, values `[L, n, H, D]`,
        bytes moved), in the pool dtype on `device` (None: CPU, where the factors are).
        """
        if self._layout is None:
            raise ValueError("no block encoded yet: nothing to decode rows from")
        lay = self._layout
        rows_np = _as_index_array("rows", rows)
        positions_np = _as_index_array("positions", positions)
        if positions_np.shape != rows_np.shape:
            raise ValueError(f"positions must be [{rows_np.shape[0]}] like rows, got {positions_np.shape}")
        if (rows_np < 0).any():
            raise ValueError(f"rows must be >= 0, got {int(rows_np.min())}")

        device = torch.device("cpu") if device is None else torch.device(device)
        n = rows_np.shape[0]
        shape = (lay.num_layers, n, lay.kv_heads, lay.head_dim)
        keys_pre = torch.empty(shape, dtype=lay.dtype, device=device)
        values = torch.empty(shape, dtype=lay.dtype, device=device)
        slots, offsets = rows_np // self.block_tokens, rows_np % self.block_tokens
        for s in np.unique(slots).tolist():
            if s not in self._slots:
                raise ValueError(f"rows include slot {s}, which has no {self.codec.name} encoding")

        bytes_moved = 0
        for s in np.unique(slots).tolist():
            code = self._slots[s]
            in_slot = np.flatnonzero(slots == s)
            piece_lo = np.array([lo for lo, _ in code.pieces], dtype=np.int64)
            piece_of = np.searchsorted(piece_lo, offsets[in_slot], side="right") - 1
            for p in np.unique(piece_of).tolist():
                out_idx = in_slot[piece_of == p]
                local = offsets[out_idx] - piece_lo[p]
                k, v = self._decode_piece(code, p, device)           # [L, Tp, H, D] each
                out_t = torch.from_numpy(out_idx).to(device)
                local_t = torch.from_numpy(local).to(device)
                keys_pre[:, out_t] = k[:, local_t]
                values[:, out_t] = v[:, local_t]
                bytes_moved += code.piece_bytes[p]
        return self._rotate(keys_pre, torch.from_numpy(positions_np)), values, bytes_moved

    # ------------------------------------------------------------ helpers

    def _code(self, slot: int) -> _SlotCode:
        slot = _as_int("slot", slot)
        code = self._slots.get(slot)
        if code is None:
            raise ValueError(f"slot {slot} has no {self.codec.name} encoding")
        return code

    def _decode_piece(self, code: _SlotCode, piece: int, device: torch.device
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """One piece, all layers, decoded on `device`: (keys_pre, values) [L, Tp, H, D]."""
        ks, vs = zip(*(self.codec.decode(per_layer[piece], device) for per_layer in code.encoded))
        return torch.stack(ks), torch.stack(vs)

    def _derotate(self, keys: torch.Tensor, start_token: int) -> torch.Tensor:
        """Pool keys [L, T, H, D] at `start_token + offset` -> pre-RoPE keys, pool dtype."""
        deltas = -(start_token + torch.arange(keys.shape[1], dtype=torch.int64))
        return self._rotate(keys, deltas)

    def _rotate(self, keys: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        """Rotate keys [L, n, H, D] by `deltas[n]` in float32 (all layers at once);
        returns a new tensor in the keys' dtype."""
        num_layers, n, heads, dim = keys.shape
        flat = keys.to(torch.float32).permute(1, 0, 2, 3).reshape(n, num_layers * heads, dim)
        out = rotate_keys(flat, deltas, self.rope)                   # float32 in, float32 out
        return out.reshape(n, num_layers, heads, dim).permute(1, 0, 2, 3).to(keys.dtype).contiguous()

    def _check_pool(self, pool: HostPool) -> _Layout:
        if not isinstance(pool, HostPool):
            raise ValueError(f"pool must be a HostPool, got {type(pool).__name__}")
        if pool.block_tokens != self.block_tokens:
            raise ValueError(f"pool has block_tokens {pool.block_tokens}, the tier {self.block_tokens}")
        _, _, num_layers, _, kv_heads, head_dim = pool.data.shape
        layout = _Layout(num_layers, kv_heads, head_dim, pool.dtype)
        if self._layout is not None and layout != self._layout:
            raise ValueError(f"pool layout {layout} differs from the tier's {self._layout}")
        return layout

    def _check_pieces(self, pieces: Sequence[tuple[int, int]] | None) -> tuple[Piece, ...]:
        bt = self.block_tokens
        if pieces is None:
            return ((0, bt),)
        try:
            checked = tuple((operator.index(lo), operator.index(hi)) for lo, hi in pieces)
        except (TypeError, ValueError) as e:
            raise ValueError(f"pieces must be (lo, hi) int pairs, got {pieces!r}") from e
        expected_lo = 0
        for lo, hi in checked:
            if lo != expected_lo or not lo < hi <= bt:
                raise ValueError(f"pieces must be non-empty [lo, hi) ranges in order covering "
                                 f"0..{bt} exactly, got {list(checked)}")
            expected_lo = hi
        if expected_lo != bt:
            raise ValueError(f"pieces must cover 0..{bt} exactly, got {list(checked)}")
        return checked


def _as_int(arg: str, x: object) -> int:
    if isinstance(x, bool):
        raise ValueError(f"{arg} must be an int, got {x!r}")
    try:
        return operator.index(x)
    except TypeError as e:
        raise ValueError(f"{arg} must be an int, got {x!r}") from e


def _as_index_array(arg: str, x: np.ndarray | torch.Tensor) -> np.ndarray:
    """A 1-D int64 numpy copy of `x` (any device)."""
    arr = np.asarray(x.cpu() if isinstance(x, torch.Tensor) else x)
    if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise ValueError(f"{arg} must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
    return arr.astype(np.int64)


__all__ = ["LowRankTier"]
