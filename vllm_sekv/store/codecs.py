"""Host-tier codecs: how one segment's K/V is stored on the host and rebuilt on the device.

A codec turns a segment's pre-RoPE keys and its values, both `[tokens, kv_heads,
head_dim]` of one layer, into an `Encoded` (host tensors, all of which move
host -> device on a restore) and back. Keys are pre-RoPE so that a codec never
sees position: the caller de-rotates before `encode` and re-rotates after
`decode` (`vllm_sekv.ops.rotate_keys`).

* `exact`: the tensors themselves; `decode` is bit-identical (NaN, inf, -0.0
  and subnormals included).
* `lowrank(r)` (SeKV): per KV head, the `[tokens, head_dim]` matrix of keys
  (separately: of values) is factored by truncated SVD (computed in fp32) into
  `A [tokens, r]` (= U * S) and `B [r, head_dim]` (= Vh), stored in the input
  dtype as `[kv_heads, tokens, r]` / `[kv_heads, r, head_dim]`. `decode`
  moves the factors to the target device first and rebuilds `A @ B` there with
  one batched matmul over heads (`torch.bmm`, fp32 accumulation, cast back).
  Bytes moved: `(tokens*r + r*head_dim) * kv_heads * 2 (K and V) * itemsize`.
  Exact fallback: when the factors would not be smaller than the data, i.e.
  `r * (tokens + head_dim) >= tokens * head_dim` (always so when
  `r >= min(tokens, head_dim)`), the segment is stored as is and decodes
  bit-identically; then it moves the raw bytes.
  `center=True` (not reachable from `parse_codec`) also stores the per-head mean
  over tokens (+head_dim elements per head and tensor) and factors the residual.
  It is off by default. Measured on SmolLM2-135M K/V (bf16, 64-token segments,
  `benchmarks/results/lowrank_study/report.md`): it lowers the mean relative Frobenius
  error by 3-4% (keys 0.250 -> 0.241, values 0.611 -> 0.592 at r = 8) for 1.6
  more points of bytes, but not the error that matters, the attention output's
  (first segment exact: 0.220 -> 0.222 at r = 8, 0.161 -> 0.168 at r = 16; all
  segments reconstructed: 0.563 -> 0.605 at r = 8, the attention sink token
  is rebuilt worse).
  Callers should keep a session's first (sink) segment exact: on the same data,
  reconstructing it too raises the attention-output error at r = 16 from 0.161
  to 0.443.

Contract (every codec): `encode` / `decode` are blocking, run on the caller's
thread, and mutate nothing. Outputs never alias inputs, except that an
`Encoded` stored exact (by `ExactCodec`, or by the `lowrank` fallback) keeps
references to the given tensors: callers must not write them afterwards.
`decode` returns new contiguous tensors in the original dtype and shape on
`device` (default: where the encoded tensors are; `"meta"` gives shapes only).
`encoded_bytes` counts the bytes of every tensor in the `Encoded`.
Failures raise `ValueError` naming the argument: shapes other than one
`[tokens, kv_heads, head_dim]` shared by K and V, an empty dim, a non-float or
mismatched dtype or device, non-finite input to a factored `lowrank` segment,
an `Encoded` made by another codec, a bad codec text or rank.
"""
from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_LOWRANK_RE = re.compile(r"lowrank\(\s*(\d+)\s*\)")


@dataclass(frozen=True)
class Encoded:
    """One segment of one layer as a codec stores it on the host.

    codec: name of the codec that produced it (`Codec.name`).
    shape: (tokens, kv_heads, head_dim) of the keys and of the values.
    dtype: dtype of the original keys/values (and of every stored tensor).
    tensors: everything that moves host -> device, by role (`keys`, `values`
        for exact storage; `keys_a`, `keys_b`, `keys_mean`, `values_*` for factors).
    """

    codec: str
    shape: tuple[int, int, int]
    dtype: torch.dtype
    tensors: dict[str, torch.Tensor]


class Codec(ABC):
    """Interface of a host-tier codec; see the module docstring for the contract."""

    name: str

    @abstractmethod
    def encode(self, keys_pre: torch.Tensor, values: torch.Tensor) -> Encoded:
        """Pre-RoPE keys and values `[tokens, kv_heads, head_dim]` -> `Encoded`."""

    @abstractmethod
    def decode(self, encoded: Encoded, device: torch.device | str | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """`Encoded` -> (keys_pre, values) in the original dtype, on `device`."""

    def encoded_bytes(self, encoded: Encoded) -> int:
        """Bytes that a restore of `encoded` moves host -> device."""
        return sum(t.numel() * t.element_size() for t in encoded.tensors.values())

    def _check_encoded(self, encoded: Encoded) -> None:
        if not isinstance(encoded, Encoded) or encoded.codec != self.name:
            got = encoded.codec if isinstance(encoded, Encoded) else type(encoded).__name__
            raise ValueError(f"encoded was made by {got!r}, not by codec {self.name!r}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def check_kv(keys_pre: torch.Tensor, values: torch.Tensor) -> tuple[int, int, int]:
    """Validate a segment's K/V pair; returns (tokens, kv_heads, head_dim)."""
    for arg, t in (("keys_pre", keys_pre), ("values", values)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{arg} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3 or 0 in t.shape:
            raise ValueError(f"{arg} must be [tokens, kv_heads, head_dim] with no empty dim, "
                             f"got {tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{arg} must have a floating dtype {FLOAT_DTYPES}, got {t.dtype}")
    if values.shape != keys_pre.shape:
        raise ValueError(f"values shape {tuple(values.shape)} != keys_pre shape {tuple(keys_pre.shape)}")
    if values.dtype != keys_pre.dtype:
        raise ValueError(f"values dtype {values.dtype} != keys_pre dtype {keys_pre.dtype}")
    if values.device != keys_pre.device:
        raise ValueError(f"values device {values.device} != keys_pre device {keys_pre.device}")
    return tuple(keys_pre.shape)


class ExactCodec(Codec):
    """Identity: stores the tensors as given; bit-identical round trip."""

    name = "exact"

    def encode(self, keys_pre: torch.Tensor, values: torch.Tensor) -> Encoded:
        shape = check_kv(keys_pre, values)
        return Encoded(self.name, shape, keys_pre.dtype, {"keys": keys_pre, "values": values})

    def decode(self, encoded: Encoded, device: torch.device | str | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_encoded(encoded)
        return _decode_exact(encoded, device)


def _decode_exact(encoded: Encoded, device: torch.device | str | None) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = encoded.tensors["keys"], encoded.tensors["values"]
    if device is None:
        return k.clone(memory_format=torch.contiguous_format), v.clone(memory_format=torch.contiguous_format)
    return k.to(device, copy=True).contiguous(), v.to(device, copy=True).contiguous()


class LowRankCodec(Codec):
    """SeKV `lowrank(r)`: per-head rank-r factors of pre-RoPE keys and of values
    (optionally of their residual after the per-head mean, `center=True`)."""

    def __init__(self, rank: int, center: bool = False) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be an int >= 1, got {rank!r}")
        if not isinstance(center, bool):
            raise ValueError(f"center must be a bool, got {center!r}")
        self.rank = rank
        self.center = center
        self.name = f"lowrank({rank},centered)" if center else f"lowrank({rank})"

    def stores_exact(self, tokens: int, head_dim: int) -> bool:
        """True when factors of a `tokens x head_dim` matrix would not be smaller than it."""
        factor_elems = self.rank * (tokens + head_dim) + (head_dim if self.center else 0)
        return factor_elems >= tokens * head_dim

    def bytes_for(self, tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """`encoded_bytes` of a segment of this shape, without encoding it: K and V each
        `(tokens*r + r*head_dim [+ head_dim if centered]) * kv_heads * itemsize`, or the
        raw bytes when `stores_exact`."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        if self.stores_exact(tokens, head_dim):
            return 2 * tokens * kv_heads * head_dim * itemsize
        per_head = tokens * self.rank + self.rank * head_dim + (head_dim if self.center else 0)
        return 2 * per_head * kv_heads * itemsize

    def encode(self, keys_pre: torch.Tensor, values: torch.Tensor) -> Encoded:
        tokens, kv_heads, head_dim = shape = check_kv(keys_pre, values)
        if self.stores_exact(tokens, head_dim):
            return Encoded(self.name, shape, keys_pre.dtype, {"keys": keys_pre, "values": values})
        tensors: dict[str, torch.Tensor] = {}
        for role, x, arg in (("keys", keys_pre, "keys_pre"), ("values", values, "values")):
            if not bool(torch.isfinite(x).all()):
                raise ValueError(f"{arg} holds non-finite values; {self.name} needs finite input")
            tensors.update(self._factor(role, x))
        return Encoded(self.name, shape, keys_pre.dtype, tensors)

    def _factor(self, role: str, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """x [T, H, D] -> {role_a [H, T, r], role_b [H, r, D] (, role_mean [H, 1, D])}."""
        m = x.to(torch.float32).transpose(0, 1)                      # [H, T, D]
        out = {}
        if self.center:
            mean = m.mean(dim=1, keepdim=True)                      # [H, 1, D]
            m = m - mean
            out[f"{role}_mean"] = mean.to(x.dtype)
        u, s, vh = torch.linalg.svd(m, full_matrices=False)        # u [H,T,k], s [H,k], vh [H,k,D]
        r = self.rank
        out[f"{role}_a"] = (u[..., :r] * s[:, None, :r]).to(x.dtype).contiguous()
        out[f"{role}_b"] = vh[:, :r, :].to(x.dtype).contiguous()
        return out

    def decode(self, encoded: Encoded, device: torch.device | str | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_encoded(encoded)
        if "keys" in encoded.tensors:
            return _decode_exact(encoded, device)
        return (self._rebuild(encoded, "keys", device), self._rebuild(encoded, "values", device))

    @staticmethod
    def _rebuild(encoded: Encoded, role: str, device: torch.device | str | None) -> torch.Tensor:
        """A @ B (+ mean) for all heads in one batched matmul on `device` -> [T, H, D]."""
        t = encoded.tensors
        a = t[f"{role}_a"].to(device).to(torch.float32)            # move first, upcast there
        b = t[f"{role}_b"].to(device).to(torch.float32)
        mean = t.get(f"{role}_mean")
        if mean is None:
            full = torch.bmm(a, b)                                  # [H, T, D]
        else:
            full = torch.baddbmm(mean.to(device).to(torch.float32), a, b)
        return full.transpose(0, 1).to(encoded.dtype).contiguous()


def parse_codec(text: str) -> Codec:
    """"exact" -> ExactCodec(); "lowrank(R)" (R an int >= 1) -> LowRankCodec(R).

    Surrounding whitespace is ignored; anything else raises ValueError naming the text.
    """
    if not isinstance(text, str):
        raise ValueError(f"codec must be a string like 'exact' or 'lowrank(16)', got {text!r}")
    s = text.strip()
    if s == "exact":
        return ExactCodec()
    m = _LOWRANK_RE.fullmatch(s)
    if m is None or int(m.group(1)) < 1:
        raise ValueError(f"codec {text!r} is not one of 'exact', 'lowrank(R)' with R an int >= 1")
    return LowRankCodec(int(m.group(1)))
