"""Blocks on their way into the views' block index.

Committed blocks (named by the plan) and blocks read back from a slower tier
wait here until a probe needs the index; then they are indexed in one batch
before the probe's forward. On the CPU only then (restores stay lean); a GPU
index takes each block as it is committed, so that no probe pays for a long
history at once, except in a step that restores (the index reads the host
tier too, and would delay the restore's first copy): the next step takes
them. With surprisal-weighted summaries each block's per-token surprisal
waits with it. Runs on the worker's forward thread.

On CUDA the index is fed on a stream of its own, which waits on the device
for the captures that wrote the blocks (`CaptureWriter.order`) and for the
work already queued on the compute stream; the compute stream waits for it
only in a step that scores (a probe reads the entries). A forward thus never
waits for the last step's capture copies to reach the host, nor for the
index's own copies and kernels. The host never waits either: the stream is
one of the capture writer's readers (`CaptureWriter.add_reader`), so later
captures never rewrite host rows it is still reading, and the writer's
`settle` covers its reads.
"""
from __future__ import annotations

import numpy as np
import torch

from vllm_sekv.index.block_index import BlockIndex
from vllm_sekv.store import HostPool
from vllm_sekv.store.capture import CaptureWriter
from vllm_sekv.worker_side.tier_transfers import BlockReadBack
from vllm_sekv.workspace.step_plan import StepPlan


class IndexFeed:
    def __init__(self, index: BlockIndex, pool: HostPool, writer: CaptureWriter, block_tokens: int) -> None:
        self.index = index
        self.pool = pool
        self.writer = writer
        self.block_tokens = block_tokens
        # slot -> first token's virtual position; a reused slot: its last block
        # counts, so this never holds more than one entry per host slot.
        self.pending: dict[int, int] = {}
        self._surprisal: dict[int, np.ndarray] = {}  # slot -> per-token surprisal, weighted kinds only
        self.stream = torch.cuda.Stream(index.device) if index.device.type == "cuda" else None
        if self.stream is not None:
            writer.add_reader(self.stream)

    def take_plan(self, plan: StepPlan) -> None:
        """The surprisal the scheduler side sent for blocks it will index."""
        if self.index.kind.uses_weights:
            self._surprisal.update(plan.index_surprisal)  # one entry per host slot at most

    def read_back(self, block: BlockReadBack) -> None:
        """A block a slower tier returned: indexed like a committed one."""
        self.pending[block.host_slot] = block.start_token
        if block.surprisal is not None and self.index.kind.uses_weights:
            self._surprisal[block.host_slot] = block.surprisal

    def update(self, plan: StepPlan) -> None:
        """Before this step's forward (its probes score with them): index the
        blocks committed since the last probe, when the module docstring's
        rule says so."""
        self.pending.update(plan.index_blocks)
        gpu_now = self.stream is not None and not plan.restores
        if self.pending and (plan.scores or gpu_now):
            self._add_pending()
        if plan.scores and self.stream is not None:
            torch.cuda.current_stream(self.index.device).wait_stream(self.stream)

    def _add_pending(self) -> None:
        latest, self.pending = self.pending, {}
        surprisal = None
        if self.index.kind.uses_weights:
            nan = np.full(self.block_tokens, np.nan, dtype=np.float32)
            surprisal = torch.from_numpy(np.stack([self._surprisal.pop(s, nan) for s in latest]))
        if self.stream is None:
            self.index.add_many(self.pool, list(latest), list(latest.values()), surprisal)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.index.device))
        self.writer.order(self.stream)
        with torch.cuda.stream(self.stream):
            self.index.add_many(self.pool, list(latest), list(latest.values()), surprisal)
