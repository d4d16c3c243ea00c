"""The fp8 workspace codec (`workspace_codec: fp8`): K/V as float8 e4m3 with
one float32 scale per (block, K or V, layer, KV head).

`scale = amax / 448` over the block's tokens and head_dim (448: the largest
finite e4m3fn value); an all-zero group gets scale 1.0. A stored element is
`round_e4m3(x / scale)` (values clamped to +-448 first, so rounding never
overflows to NaN); it reads back as `float(q) * scale`. e4m3 keeps 3 mantissa
bits: an element whose scaled magnitude is a normal e4m3 number (>= 2**-6) is
off by at most 2**-4 of itself, a subnormal one by at most 2**-10 (half the
spacing 2**-9), all times `scale`.

Keys are quantized as the pool stores them (post-RoPE at their stored
position); a restore dequantizes on the device, rotates in float32 and rounds
once to the cache dtype (`ops.scatter_rerope` with `scales`).

Non-finite input (NaN, +-inf) cannot be stored in e4m3 with a meaningful
scale: such a group's scale is NaN (`quantize` reports it through its
`finite` mask) and the pool fails the slot (a miss, recomputed), so a block
with non-finite K/V is never served quantized.

Pure torch, any device; nothing is mutated except the `out` tensors given.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
CODECS = ("exact", "fp8")


def quantize(x: torch.Tensor, token_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`x [..., tokens, heads, head_dim]` (tokens at `token_dim`, head_dim
    last) -> (fp8 values of x's shape, float32 scales with x's shape less the
    token and head_dim dims, a bool mask of the groups that were finite).
    Groups with non-finite input get scale NaN and zero values."""
    token_dim = token_dim % x.dim()
    xf = x.to(torch.float32)
    finite_elems = torch.isfinite(xf)
    finite = finite_elems.all(dim=-1).all(dim=token_dim)
    amax = xf.abs().nan_to_num(0.0, 0.0, 0.0).amax(dim=-1).amax(dim=token_dim)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
    s = scale.unsqueeze(token_dim).unsqueeze(-1)
    q = (xf / s).nan_to_num(0.0, 0.0, 0.0).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale, finite


def dequantize(q: torch.Tensor, scale: torch.Tensor, token_dim: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`float(q) * scale` in `dtype` (computed in float32); `scale` has q's
    shape less the token and head_dim dims, as `quantize` returns it."""
    token_dim = token_dim % q.dim()
    s = scale.to(q.device, torch.float32).unsqueeze(token_dim).unsqueeze(-1)
    return (q.to(torch.float32) * s).to(dtype)


def error_bound(x: torch.Tensor, scale: torch.Tensor, token_dim: int) -> torch.Tensor:
    """Largest error one e4m3 rounding may leave on each element of `x`
    (float32, x's shape): 2**-4 of |x| for normal scaled values, plus half
    the subnormal spacing (2**-10) times the scale."""
    token_dim = token_dim % x.dim()
    s = scale.to(torch.float32).unsqueeze(token_dim).unsqueeze(-1)
    return x.to(torch.float32).abs() * 2.0 ** -4 + s * 2.0 ** -10
