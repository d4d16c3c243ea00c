"""SeKV coarse attention, worker side: the summaries of the history a view
leaves out, merged into the attention of the view's tokens.

Per request whose view has summaries (`CoarseOp` in the step plan):
  `begin`        (before the forward of the view's first step) builds every
                 layer's summaries from the host pool, on the device: the
                 pool's keys de-rotated to pre-RoPE, surprisal-weighted per
                 summary (`segment_summaries.group_weights`), rotated to the
                 summary's view position; values likewise, unrotated. It also
                 takes the view's restored history keys, as the restore
                 writes them, into the request's own key buffer;
  `keys_written` (capture hook, per layer) adds the keys of the request's
                 tokens computed in this step to that buffer;
  `merge`        (attention hook, per layer, after the platform's attention):
                 the log-sum-exp of each of the request's rows over the view
                 is recomputed from the buffer (platform backends do not
                 return it) and the summaries are merged in by log-sum-exp
                 (`ops.coarse_merge`; Triton on CUDA), in place;
  `finish`       drops a request's state.
The buffer is one more copy of the view's keys per request: the paged cache
is never parsed by hand (its layout is the platform's). Which positions it
holds is tracked on the host, so that the per-layer calls never wait for the
GPU. A row whose view keys are not all known (never expected) is left as the
platform computed it and counted, never merged against a partial log-sum-exp.

Runs in the worker process, on the forward thread; blocking.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from vllm_sekv.ops import coarse_merge, rotate_keys
from vllm_sekv.store.host_pool import to_device
from vllm_sekv.workspace.step_plan import CoarseSummaries
from vllm_sekv.workspace.segment_summaries import group_weights

logger = logging.getLogger("vllm_sekv")

# K/V `[n, L, H, D]` of host rows `[n]`, on the summaries' device (`HostPool.rows_on`).
RowReader = Callable[[np.ndarray], tuple[torch.Tensor, torch.Tensor]]
CHUNK_ROWS = 8192  # rows summarized at a time: about 0.5 GB of K/V on Llama-3-8B's geometry


@dataclass(frozen=True)
class StepRows:
    """One request's tokens in this step's batch, made once per step."""

    rows: torch.Tensor  # [m] batch rows, on the batch's device
    positions: torch.Tensor  # [m] view positions, on the host
    positions_dev: torch.Tensor  # the same on the device

    @classmethod
    def of(cls, rows: np.ndarray, positions: np.ndarray, device: torch.device) -> "StepRows":
        return cls(to_device(rows, device), torch.from_numpy(positions), to_device(positions, device))


@dataclass
class _Request:
    k_sum: torch.Tensor  # [L, S, H, D] post-RoPE at the summaries' view positions
    v_sum: torch.Tensor  # [L, S, H, D]
    num_tokens: torch.Tensor  # [S] int64
    keys: torch.Tensor  # [L, capacity, H, D] the view's keys as the paged cache holds them
    known: torch.Tensor  # [L, capacity] bool, on the host: the buffer holds that layer's key there


class CoarseAttention:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, rope) -> None:
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device, self.rope = dtype, device, rope
        self.requests: dict[str, _Request] = {}
        self.skipped_rows = 0  # rows left unmerged (view keys not all known), over all layers

    def summary_bytes(self, req_id: str) -> int:
        """Device bytes of a request's summaries (K and V, every layer)."""
        r = self.requests[req_id]
        return 2 * r.k_sum.numel() * r.k_sum.element_size()

    def begin(self, req_id: str, spec: CoarseSummaries, read_rows: RowReader,
              history_keys: torch.Tensor, history_start: int) -> None:
        """Build `req_id`'s summaries from the summarized rows' pool K/V and
        take the view's restored keys `history_keys [L, m, H, D]` (view
        positions `history_start ..`) into its buffer. Replaces any earlier
        state. `read_rows(host_rows)` gives those rows' K/V `[n, L, H, D]` on
        this device (keys post-RoPE at `spec.virtual_positions`); they are read
        `CHUNK_ROWS` at a time, so a whole history's left-out rows are
        summarized on the device in bounded memory, never on the host."""
        num_layers, heads, dim, dev = self.num_layers, self.kv_heads, self.head_dim, self.device
        num_sum = len(spec.num_tokens)
        weights, _ = group_weights(torch.from_numpy(spec.summary_of), torch.from_numpy(spec.surprisal).float(),
                                   num_sum)
        k_sum = torch.zeros(num_sum, num_layers * heads, dim, device=dev)  # float32
        v_sum = torch.zeros_like(k_sum)
        for lo in range(0, len(spec.host_rows), CHUNK_ROWS):
            hi = min(lo + CHUNK_ROWS, len(spec.host_rows))
            keys, values = read_rows(spec.host_rows[lo:hi])
            group, w = to_device(spec.summary_of[lo:hi], dev), to_device(weights[lo:hi], dev)[:, None, None]
            pre = rotate_keys(keys.reshape(hi - lo, num_layers * heads, dim),
                              -to_device(spec.virtual_positions[lo:hi], dev), self.rope)
            k_sum.index_add_(0, group, pre * w)
            v_sum.index_add_(0, group, values.reshape(hi - lo, num_layers * heads, dim).float() * w)
        k_sum = rotate_keys(k_sum, to_device(spec.summary_positions, dev), self.rope)

        def per_layer(x: torch.Tensor) -> torch.Tensor:  # [S, L*H, D] -> [L, S, H, D] on the device
            return x.reshape(num_sum, num_layers, heads, dim).transpose(0, 1).to(self.device, self.dtype).contiguous()

        capacity = max(spec.history_tokens, history_start + history_keys.shape[1]) + 256
        state = _Request(per_layer(k_sum), per_layer(v_sum),
                         torch.from_numpy(spec.num_tokens).to(self.device),
                         torch.zeros((num_layers, capacity, heads, dim), dtype=self.dtype, device=self.device),
                         torch.zeros((num_layers, capacity), dtype=torch.bool))
        self.requests[req_id] = state
        self._store(state, slice(None), torch.arange(history_start, history_start + history_keys.shape[1]),
                    history_keys)

    def _store(self, state: _Request, layers: slice | int, positions: torch.Tensor, keys: torch.Tensor,
               positions_dev: torch.Tensor | None = None) -> None:
        if not len(positions):
            return
        need = int(positions.max()) + 1
        capacity = state.known.shape[1]
        if need > capacity:  # grow by doubling (decode appends one position per step)
            grow = max(need, 2 * capacity) - capacity
            state.keys = torch.cat([state.keys, state.keys.new_zeros((self.num_layers, grow, *state.keys.shape[2:]))], 1)
            state.known = torch.cat([state.known, state.known.new_zeros((self.num_layers, grow))], 1)
        if positions_dev is None:
            positions_dev = to_device(positions, self.device)
        state.keys[layers, positions_dev] = keys.to(self.device, self.dtype)
        state.known[layers, positions] = True

    def keys_written(self, req_id: str, layer: int, keys: torch.Tensor, step: StepRows) -> None:
        """This step's keys `[m, H, D]` (on the device) of the request's tokens."""
        state = self.requests.get(req_id)
        if state is not None:
            self._store(state, layer, step.positions, keys, step.positions_dev)

    def merge(self, req_id: str, layer: int, query: torch.Tensor, output: torch.Tensor,
              step: StepRows, scale: float) -> int:
        """Merge the summaries into the request's rows of `output` (in place);
        returns how many rows were merged. `query` `[tokens, Hq, D]` and
        `output` `[tokens, Hq, D]` are the layer's attention input and output."""
        state = self.requests.get(req_id)
        rows, positions, positions_dev = step.rows, step.positions, step.positions_dev
        if state is None or not len(rows):
            return 0
        top = int(positions.max()) + 1
        complete = torch.cumprod(state.known[layer, :top].int(), 0).bool()[positions]
        if not bool(complete.all()):
            self.skipped_rows += int((~complete).sum())
            keep = to_device(complete, rows.device)
            rows, positions_dev = rows[keep], positions_dev[keep]
            if not len(rows):
                return 0
        q = query[rows]
        lse_view = _view_lse(q, state.keys[layer, :top], positions_dev, scale)
        merged, _ = coarse_merge(q, output[rows], lse_view, state.k_sum[layer], state.v_sum[layer],
                                 state.num_tokens, scale)
        output[rows] = merged.to(output.dtype)
        return len(rows)

    def finish(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self.requests.pop(req_id, None)


def _view_lse(q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
    """log-sum-exp over view keys `keys [P, H, D]` of each query `q [m, Hq, D]`
    at view `positions [m]` (causal: key j is seen when j <= position), float32 [m, Hq]."""
    group = q.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)  # [P, Hq, D]
    logits = torch.einsum("mhd,phd->mhp", q.float(), k) * scale
    hidden = torch.arange(keys.shape[0], device=keys.device)[None, :] > positions[:, None]  # [m, P]
    return torch.logsumexp(logits.masked_fill(hidden[:, None, :], float("-inf")), dim=-1)
