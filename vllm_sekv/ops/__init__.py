"""Compute primitives, dispatched by device: Triton kernels on CUDA, their
PyTorch references elsewhere. Callers never pick an implementation
themselves. One operator, one folder: `rope/` (rotation, scatter, gather),
`scoring/` (block-index scoring), `coarse/` (the SeKV merge), each kernel
beside a reference with the same contract.

* `rotate_keys(keys, delta_positions, rope)`: pure rotation (bit-identical to
  the reference on CUDA, one launch; see `vllm_sekv/ops/rope/rotate.py`).
* `rotate_layer_keys_(keys, delta_positions, rope)`: the same rotation of
  `[layers, tokens, heads, head_dim]` keys, in place.
* `score_sub_blocks(queries, entries, layer, slots, valid)`: per query head,
  sum over queries of the softmax over candidate blocks of each block's
  logsumexp logit over its S index vectors, `[Hq, B]` float32 (see
  `vllm_sekv/ops/scoring/sub_block_scoring.py`; the kernel takes S and D powers of two).
* `scatter_rerope(staging, key_caches, value_caches, slot_mapping,
  delta_positions, rope, src_rows=None, scales=None)`: staged blocks (rows
  `src_rows` of `staging`) -> paged caches, K re-RoPE'd (`delta_positions`
  None: copied); fp8 staging with its `scales` is dequantized on the way
  (see `vllm_sekv/ops/rope/scatter_reference.py`).
* `dequantize_rerope(key, value, params, delta_positions, rope, dtype)`:
  an fp8 pool's blocks -> model-dtype `[layers, tokens, kv_heads, head_dim]`
  K and V, keys re-RoPE'd, in one pass (see
  `vllm_sekv/ops/rope/dequant_reference.py`).
* `gather_rerope(key_caches, value_caches, slots, delta_positions, rope,
  out)`: paged caches -> a `[2, layers, n, kv_heads, head_dim]` capture
  buffer, K re-RoPE'd (see `vllm_sekv/ops/rope/gather.py`).
* `coarse_merge(q, out_view, lse_view, k_sum, v_sum, summary_tokens, scale)`:
  SeKV summaries merged into view attention by log-sum-exp (see
  `vllm_sekv/ops/coarse/coarse_reference.py`).

Triton modules are imported lazily, so CPU-only installs never import Triton.
"""
from __future__ import annotations

from typing import Sequence

import torch

from vllm_sekv.ops.coarse import coarse_reference as _coarse_ref
from vllm_sekv.ops.rope import dequant_reference as _dequant_ref
from vllm_sekv.ops.rope import rotate_reference as _rope_ref
from vllm_sekv.ops.rope import scatter_reference as _scatter_ref
from vllm_sekv.ops.rope.rope_spec import RopeSpec
from vllm_sekv.ops.scoring import sub_block_reference as _scoring_ref


_ROTATE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _use_triton(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda


def rotate_keys(keys: torch.Tensor, delta_positions: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    """Keys `[tokens, heads, head_dim]` rotated by `delta_positions [tokens]`
    (a new tensor; see `rope.rotate_reference`). Triton on CUDA, reference
    elsewhere (bit-identical)."""
    if _use_triton(keys) and keys.dtype in _ROTATE_DTYPES:
        from vllm_sekv.ops.rope import rotate

        return rotate.rotate_keys(keys if keys.stride(-1) == 1 else keys.contiguous(), delta_positions, rope)
    return _rope_ref.rotate_keys(keys, delta_positions, rope)


def rotate_layer_keys_(keys: torch.Tensor, delta_positions: torch.Tensor, rope: RopeSpec) -> None:
    """Rotate `keys [layers, tokens, heads, head_dim]` by `delta_positions
    [tokens]` in place (every layer by the same deltas)."""
    if _use_triton(keys) and keys.dtype in _ROTATE_DTYPES and keys.stride(-1) == 1:
        from vllm_sekv.ops.rope import rotate

        rotate.rotate_keys(keys, delta_positions, rope, out=keys)
        return
    layers, tokens, heads, dim = keys.shape
    flat = keys.transpose(0, 1).reshape(tokens, layers * heads, dim)
    keys.copy_(_rope_ref.rotate_keys(flat, delta_positions, rope).reshape(tokens, layers, heads, dim).transpose(0, 1))


def score_sub_blocks(queries: torch.Tensor, entries: torch.Tensor, layer: int, slots: torch.Tensor,
                     valid: torch.Tensor) -> torch.Tensor:
    """Block-index scores of logsumexp summary kinds; Triton on CUDA, reference
    elsewhere (the same to about 1e-5 relative)."""
    if _use_triton(queries) and _use_triton(entries):
        from vllm_sekv.ops.scoring import sub_block_scoring

        return sub_block_scoring.score_sub_blocks(queries, entries, layer, slots, valid)
    return _scoring_ref.score_sub_blocks_reference(queries, entries, layer, slots, valid)


def warm_up_scoring(entries: torch.Tensor, q_heads: int) -> int:
    """Compile the Triton scoring kernel's variants for `entries` up front
    (`sub_block_scoring.warm_up`); returns how many query counts it scored."""
    from vllm_sekv.ops.scoring import sub_block_scoring

    return sub_block_scoring.warm_up(entries, q_heads)


def scatter_rerope(staging: torch.Tensor, key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor],
                   slot_mapping: torch.Tensor, delta_positions: torch.Tensor | None, rope: RopeSpec,
                   src_rows: torch.Tensor | None = None, scales: torch.Tensor | None = None) -> None:
    """Scatter + re-RoPE into paged caches (keys not rotated without
    `delta_positions`; fp8 staging dequantized by `scales`); Triton on CUDA,
    reference elsewhere."""
    if _use_triton(staging) and key_caches and _use_triton(key_caches[0]):
        from vllm_sekv.ops.rope import scatter

        return scatter.scatter_rerope(staging, key_caches, value_caches, slot_mapping, delta_positions, rope, src_rows,
                                      scales=scales)
    return _scatter_ref.scatter_rerope(staging, key_caches, value_caches, slot_mapping, delta_positions, rope, src_rows,
                                       scales)


def dequantize_rerope(key: torch.Tensor, value: torch.Tensor, params: torch.Tensor,
                      delta_positions: torch.Tensor | None, rope: RopeSpec,
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 blocks `[n, layers, block_tokens, kv_heads, head_dim]` and their
    parameters -> (keys, values) `[layers, tokens, kv_heads, head_dim]` in
    `dtype`, keys rotated by `delta_positions` (None: not rotated); Triton on
    CUDA (bit-identical), reference elsewhere."""
    if _use_triton(key) and dtype in _ROTATE_DTYPES and key.stride(-1) == 1 and params.stride(-1) == 1:
        from vllm_sekv.ops.rope import dequant

        return dequant.dequantize_rerope(key, value, params, delta_positions, rope, dtype)
    return _dequant_ref.dequantize_rerope(key, value, params, delta_positions, rope, dtype)


def gather_rerope(key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor], slots: torch.Tensor,
                  delta_positions: torch.Tensor | None, rope: RopeSpec, out: torch.Tensor) -> torch.Tensor:
    """Paged caches -> capture buffer, K re-RoPE'd; Triton on CUDA (bit-identical), reference elsewhere."""
    if _use_triton(out) and key_caches and _use_triton(key_caches[0]) and out.dtype in _ROTATE_DTYPES:
        from vllm_sekv.ops.rope import gather

        return gather.gather_rerope(key_caches, value_caches, slots, delta_positions, rope, out)
    return _scatter_ref.gather_rerope(key_caches, value_caches, slots, delta_positions, rope, out)


def coarse_merge(q: torch.Tensor, out_view: torch.Tensor, lse_view: torch.Tensor, k_sum: torch.Tensor,
                 v_sum: torch.Tensor, summary_tokens: torch.Tensor,
                 scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """SeKV coarse-attention merge; Triton on CUDA, reference elsewhere (same result)."""
    if _use_triton(q):
        from vllm_sekv.ops.coarse import coarse_kernel

        return coarse_kernel.coarse_merge(q, out_view, lse_view, k_sum, v_sum, summary_tokens, scale)
    return _coarse_ref.coarse_merge(q, out_view, lse_view, k_sum, v_sum, summary_tokens, scale)


__all__ = ["RopeSpec", "rotate_keys", "rotate_layer_keys_", "score_sub_blocks", "warm_up_scoring", "scatter_rerope",
           "dequantize_rerope", "gather_rerope", "coarse_merge"]
