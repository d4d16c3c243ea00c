"""The fp8 workspace codec (`workspace_codec: fp8`): K/V as float8 e4m3
around per-channel centres, with float32 parameters per (block, K or V,
layer, KV head): `[scale, centre_0 .. centre_{D-1}]` (`1 + head_dim` values).

A channel's centre is its mean over the block's tokens where that mean is
more than `CENTRE_GATE` (4) of its standard deviations from 0 (a bias: the
channel hardly changes within the block), else 0. The residual `x - centre`
is stored, with `scale = amax(|x - centre|) / 448` over the block's tokens
and head_dim (448: the largest finite e4m3fn value; an all-zero residual
gets scale 1.0). A stored element is `round_e4m3((x - centre) / scale)`
(clamped to +-448 first, so rounding never overflows to NaN); it reads back
as `float(q) * scale + centre`. e4m3 keeps 3 mantissa bits: an element whose
scaled residual is a normal e4m3 number (>= 2**-6) is off by at most 2**-4
of its residual, a subnormal one by at most 2**-10 (half the spacing
2**-9), all times `scale`.

Why centres: some models' keys hold a few large channels that change little
from token to token (the key projection's bias: Qwen2.5's reach 358 where
the rest are of order 1-10). Quantized as they are, e4m3's relative error
turns them into noise of several units that differs per token, on every
attention logit, and the model stops answering
(`benchmarks/results/fp8_codec/answers.md`). Why only there: a channel that
varies about 0 is better kept as it is, where each element's error is
relative to itself; centring it moves error onto the tokens near 0, and on
SmolLM2 centring every channel raised the attention output's error from
0.028 to 0.036 where the gate lowers it to 0.023
(`benchmarks/results/fp8_codec/report.md`). The centres cost 4 bytes per
channel per block and group: with 32-token blocks the host tier holds 0.56
of the exact codec's bytes.

Keys are quantized as the pool stores them (post-RoPE at their stored
position); a restore dequantizes on the device, rotates in float32 and rounds
once to the cache dtype (`ops.scatter_rerope` with `scales`).

Non-finite input (NaN, +-inf) cannot be stored in e4m3 with a meaningful
scale: such a group's scale is NaN (`quantize` reports it through its
`finite` mask) and the pool fails the slot (a miss, recomputed), so a block
with non-finite K/V is never served quantized.

Over an fp8 paged cache (`--kv-cache-dtype fp8`) the tier keeps the bytes
the cache holds instead: vLLM's e4m3 with one scale per layer for K and one
for V (the attention layer's `k_scale`, `v_scale`) and no centres. Such
blocks are stored in the same form, their parameters the layer's scale and
zero centres (`cache_params`), so every reader dequantizes them as any
other; `quantize_with` rounds values to those fixed parameters (keys a
capture or restore moves, rotated in float32).

Pure torch, any device; nothing is mutated except the `out` tensors given.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
CODECS = ("exact", "fp8")
# A channel is centred where its mean over the block is this many standard deviations from 0.
CENTRE_GATE = 4.0


def quantize(x: torch.Tensor, token_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`x [..., tokens, heads, head_dim]` (tokens at `token_dim`, head_dim
    last) -> (fp8 residuals of x's shape; float32 parameters, x's shape less
    the token dim with head_dim + 1 values last: scale, then the centre per
    channel; a bool mask of the groups that were finite). Groups with
    non-finite input get scale NaN, centre 0 and zero values. A channel's
    centre is its mean where that is more than `CENTRE_GATE` of its standard
    deviations from 0, else 0."""
    token_dim = token_dim % x.dim()
    xf = x.to(torch.float32)
    finite = torch.isfinite(xf).all(dim=-1).all(dim=token_dim)
    clean = xf.nan_to_num(0.0, 0.0, 0.0)
    std, mean = torch.std_mean(clean, dim=token_dim, correction=0, keepdim=True)
    centred = finite.unsqueeze(token_dim).unsqueeze(-1) & (mean.abs() > CENTRE_GATE * std)
    centre = torch.where(centred, mean, torch.zeros_like(mean))
    residual = xf - centre
    amax = residual.abs().nan_to_num(0.0, 0.0, 0.0).amax(dim=-1).amax(dim=token_dim)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
    s = scale.unsqueeze(token_dim).unsqueeze(-1)
    q = (residual / s).nan_to_num(0.0, 0.0, 0.0).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, torch.cat([scale.unsqueeze(-1), centre.squeeze(token_dim)], dim=-1), finite


def cache_params(k_scales: list[float], v_scales: list[float], kv_heads: int, head_dim: int) -> torch.Tensor:
    """Parameters `[2, layers, kv_heads, 1 + head_dim]` float32 of bytes as an
    fp8 paged cache holds them: layer l's K scale, then its V scale, for
    every head, and zero centres."""
    params = torch.zeros((2, len(k_scales), kv_heads, 1 + head_dim), dtype=torch.float32)
    params[0, :, :, 0] = torch.tensor(k_scales, dtype=torch.float32)[:, None]
    params[1, :, :, 0] = torch.tensor(v_scales, dtype=torch.float32)[:, None]
    return params


def quantize_with(x: torch.Tensor, params: torch.Tensor, token_dim: int) -> torch.Tensor:
    """`x` rounded to e4m3 under fixed `params` (x's shape less the token
    dim, `1 + head_dim` values last): `round_e4m3(clamp((x - centre) / scale,
    +-448))`, computed in float32 where x is. Non-finite input comes out as 0
    (NaN) or +-448 (inf): callers of fixed scales store what they are given."""
    token_dim = token_dim % x.dim()
    scale, centre = parts(params.to(x.device), token_dim)
    q = ((x.to(torch.float32) - centre) / scale).nan_to_num(0.0, FP8_MAX, -FP8_MAX)
    return q.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_blocks(blocks: torch.Tensor, scratch_bytes: int):
    """`quantize` of `blocks [m, 2, L, bt, H, D]` (tokens at dim 3) a few
    blocks at a time, so the scratch it takes where the blocks are (about 20
    bytes per element) stays near `scratch_bytes`: yields `(first, q, params,
    finite)` for blocks `first .. first + len(q) - 1`, each block's `finite`
    reduced to one flag."""
    step = max(1, scratch_bytes // (blocks[0].numel() * 20))
    for first in range(0, len(blocks), step):
        q, params, finite = quantize(blocks[first : first + step], token_dim=3)
        yield first, q, params, finite.reshape(len(q), -1).all(dim=1)


def parts(params: torch.Tensor, token_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, centre) of `params` as `quantize` returns them, each shaped to
    broadcast against the values (`token_dim` as there), in float32."""
    params = params.to(torch.float32)
    scale = params[..., 0].unsqueeze(token_dim).unsqueeze(-1)
    return scale, params[..., 1:].unsqueeze(token_dim)


def dequantize(q: torch.Tensor, params: torch.Tensor, token_dim: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`float(q) * scale + centre` in `dtype` (computed in float32); `params`
    as `quantize` returns them (q's shape less the token dim, head_dim + 1
    values last)."""
    token_dim = token_dim % q.dim()
    scale, centre = parts(params.to(q.device), token_dim)
    return (q.to(torch.float32) * scale + centre).to(dtype)


def error_bound(x: torch.Tensor, params: torch.Tensor, token_dim: int) -> torch.Tensor:
    """Largest error one e4m3 rounding may leave on each element of `x`
    (float32, x's shape): 2**-4 of its residual |x - centre| for normal
    scaled values, plus half the subnormal spacing (2**-10) times the scale."""
    token_dim = token_dim % x.dim()
    scale, centre = parts(params, token_dim)
    return (x.to(torch.float32) - centre).abs() * 2.0 ** -4 + scale * 2.0 ** -10
