"""The views' block index: a few summary vectors per block, layer and KV head.

Entry `entries[slot]` is `[num_layers, S, kv_heads, head_dim]` for the block
held in host slot `slot`, valid while `valid[slot]`; `S` and how the vectors
are made depend on the summary kind (`index.block_summaries`, e.g. `sub4_pre`:
the means of the block's eight 4-token pieces, pre-RoPE; `mean_pre`: KVMEM's
Mean-K). The pool stores keys post-RoPE at their virtual positions, so each
token's key is first rotated back by its position (a pure rotation by
`-position` from the model's inverse frequencies).

`score` is the probe's half: per layer, the new tokens' queries against the
candidates' entries, `sum over queries of softmax over candidates` per query
head. Entries are kept in bfloat16 (an eighth of the block's K/V bytes for
`sub4_pre` with 32-token blocks); scoring runs in float32. Kinds that weight
tokens by their surprisal (SeKV: `anchor_pre` keeps the key of the block's
highest-surprisal token) take it per block in `add_many`.

On CUDA, kinds whose block logit is the logsumexp of its vectors (`sub4_pre`,
`mean_pre`, `anchor_pre`; S and head_dim powers of two) score with one fused
Triton kernel (`ops.score_sub_blocks`), which reads the candidates' entries in
place; float32 queries reach the matrix unit as two bf16 parts, so the scores
match the float32 path to about 1e-5. `fused` says whether `score` takes it
(benchmarks set it False to time the PyTorch path).

The index lives on `device` (the worker puts it on the GPU on CUDA: blocks'
keys move there once, when indexed, and probes score there); queries must
come on that device, scores go back on it.

Runs in the worker process, on the forward thread. On CUDA `add_many` and
`score` never wait for the device (the blocks' keys come from the pinned
host tier by the copy engine, `HostPool.slot_keys_on`); elsewhere blocking.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from vllm_sekv import ops
from vllm_sekv.ops import RopeSpec, rotate_keys
from vllm_sekv.store import HostPool
from vllm_sekv.store.host_pool import to_device
from vllm_sekv.index import block_summaries as summaries

logger = logging.getLogger("vllm_sekv")


class BlockIndex:
    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        rope: RopeSpec,
        kind: str = "sub4_pre",
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
    ) -> None:
        self.kind = summaries.get_kind(kind)
        self.rope = rope
        self.device = torch.device(device)
        s = self.kind.vectors_per_block
        self.entries = torch.zeros((num_slots, num_layers, s, kv_heads, head_dim), dtype=dtype, device=self.device)
        self.valid = torch.zeros(num_slots, dtype=torch.bool, device=self.device)
        self.fused = (self.device.type == "cuda" and self.kind.logsumexp_logits
                      and _power_of_two(s) and _power_of_two(head_dim) and head_dim >= 16)

    @property
    def query_space(self) -> str:
        """"pre": score with pre-RoPE queries; "post": rotated to their virtual positions."""
        return self.kind.query_space

    def add(self, pool: HostPool, slot: int, start_token: int) -> None:
        """Index the block in `slot`, whose first token sits at virtual position `start_token`."""
        self.add_many(pool, [slot], [start_token])

    def add_many(self, pool: HostPool, slots: list[int], start_tokens: list[int],
                 surprisal: torch.Tensor | None = None, chunk: int = 128) -> None:
        """Index several blocks (distinct slots), `chunk` at a time: one
        rotation and one summary per chunk. `surprisal` [len(slots),
        block_tokens] (NaN: unknown) weights the tokens of kinds that use it
        (`block_summaries.surprisal_weights`; uniform where unknown)."""
        for c in range(0, len(slots), chunk):
            idx = to_device(np.asarray(slots[c : c + chunk], dtype=np.int64), self.device)
            starts = to_device(np.asarray(start_tokens[c : c + chunk], dtype=np.int64), self.device)
            keys = pool.slot_keys_on(slots[c : c + chunk], self.device)  # [n, L, T, H, D], post-RoPE
            n, num_layers, num_tokens, kv_heads, head_dim = keys.shape
            post = keys.permute(0, 2, 1, 3, 4).reshape(n * num_tokens, num_layers * kv_heads, head_dim).float()
            positions = (starts[:, None] + torch.arange(num_tokens, device=self.device)[None, :]).reshape(-1)
            pre = rotate_keys(post, -positions, self.rope)
            weights = None
            if self.kind.uses_weights:
                h = surprisal[c : c + chunk] if surprisal is not None else torch.zeros(n, num_tokens)
                h = to_device(h, self.device)
                weights = summaries.surprisal_weights(h.reshape(-1).float(), num_tokens)  # [n * T]
            summary = summaries.summarize_blocks(self.kind, pre, post, weights, block_tokens=num_tokens)
            s = summary.shape[1]  # [n, S, L*H, D] -> [n, L, S, H, D]
            entries = summary.reshape(n, s, num_layers, kv_heads, head_dim).transpose(1, 2)
            self.entries[idx] = entries.to(self.entries.dtype)
            self.valid.index_fill_(0, idx, True)  # `valid[idx] = True` copies the scalar: a synchronization

    def warm_up(self, q_heads: int) -> None:
        """Compile the fused scoring kernel's variants now (a second or so
        each on a machine's first start, from Triton's cache afterwards), so
        that no probe waits for a compile. Nothing to do off the fused path."""
        if self.fused:
            n = ops.warm_up_scoring(self.entries, q_heads)
            logger.info("sekv: block index scoring compiled for %d query-count tiles", n)

    def drop(self, slot: int) -> None:
        self.valid[slot] = False

    def score(self, layer: int, queries: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """queries [M, Hq, D] (in `query_space`), candidate `slots` [B] ->
        [Hq, B]: per query head, the sum over queries of the softmax over the
        candidates. Candidates not indexed take no part and score 0.

        Never waits for the device (it runs inside the forward pass): every
        candidate is scored and the unindexed ones are masked out, instead of
        selecting the indexed ones (a data-dependent shape)."""
        slots = slots.to(self.device)
        if self.fused:
            return ops.score_sub_blocks(queries, self.entries, layer, slots, self.valid)
        valid = self.valid[slots]
        entries = self.entries[slots, layer].float()  # [B, S, H, D]
        logits = summaries.block_logits(self.kind, queries.float(), entries)  # [M, Hq, B]
        probs = torch.softmax(logits.masked_fill(~valid, float("-inf")), dim=-1)
        return probs.nan_to_num_(0.0).sum(0)  # no candidate indexed: 0/0 -> 0


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
