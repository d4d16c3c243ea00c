"""Per-token surprisal from the served model's own next-token distribution (SeKV).

`H_t = -log p(x_t | x_<t)` in nats, for every token a request computes and the
workspace keeps. SeKV segments, anchors and the surprisal-weighted block
summaries are made from it.

Runs in the worker process, on the forward thread, as a forward hook on the
model (`model.register_forward_hook`, installed at start-up when the config's
`surprisal` is on). After the model's forward, for each `SurprisalOp` of the
step: the hidden states of the request's tokens go through the model's own
`compute_logits` (its LM head; `CHUNK_TOKENS` rows at a time, so the logits
never take more than `CHUNK_TOKENS x vocab` floats), and the hidden state at
position `t - 1` scores token `x_t`, read from the forward's `input_ids`. The
predecessor of a request's first token in a step is the last token it computed
in its previous step: its hidden row is kept per request, and used only if it
sits exactly one virtual position before. Otherwise (the first new token after
a restored history) the token's surprisal is unknown: NaN, which every consumer
treats as 0 (not an anchor, no weight).

Cost: the LM head over every computed token, `vocab x hidden` multiply-adds per
token (SmolLM2-135M: 28M, about a fifth of its forward pass; Llama-3-8B: 0.5G,
about 7%), plus a log-softmax over the vocabulary. Blocking; mutates only its
own state. Ranks whose `compute_logits` returns None (tensor parallelism
gathers logits to one rank) record nothing; the scheduler side takes the rank
that did.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import torch

from vllm_sekv.workspace.step_plan import SurprisalOp

CHUNK_TOKENS = 256
MAX_KEPT_REQUESTS = 4096  # hidden rows kept for the next step, oldest dropped first

# paged slots -> (found mask, batch rows of the found ones)
RowLookup = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]


class SurprisalRecorder:
    def __init__(self, model: torch.nn.Module) -> None:
        if not callable(getattr(model, "compute_logits", None)):
            raise ValueError(f"{type(model).__name__} has no compute_logits: cannot record surprisal")
        self.model = model
        self._ops: list[SurprisalOp] = []
        self._rows_of: RowLookup | None = None
        self._stash: dict[str, tuple[int, torch.Tensor]] = {}  # req_id -> (virtual position, hidden row)
        self._out_rows: list[np.ndarray] = []
        self._out_values: list[np.ndarray] = []
        self.recorded_tokens = 0
        self.seconds = 0.0
        self._handle = model.register_forward_hook(self._after_forward, with_kwargs=True)

    def bind(self, ops: list[SurprisalOp], rows_of: RowLookup) -> None:
        """This step's ops; `rows_of` finds their tokens' rows in the batch."""
        self._ops, self._rows_of = ops, rows_of

    def take(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(host rows, surprisal) recorded since the last call, or None."""
        if not self._out_rows:
            return None
        out = np.concatenate(self._out_rows), np.concatenate(self._out_values)
        self._out_rows, self._out_values = [], []
        return out

    def close(self) -> None:
        self._handle.remove()

    # ------------------------------------------------------------ internals

    def _after_forward(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        ops, self._ops = self._ops, []
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        hidden = output[0] if isinstance(output, tuple) else output
        if not ops or input_ids is None or not isinstance(hidden, torch.Tensor) or self._rows_of is None:
            return
        t0 = time.perf_counter()
        with torch.no_grad():
            for op in ops:
                self._record(op, hidden, input_ids)
        self.seconds += time.perf_counter() - t0

    def _record(self, op: SurprisalOp, hidden: torch.Tensor, input_ids: torch.Tensor) -> None:
        found, rows = self._rows_of(op.paged_slots)
        if not found.all():  # a token missing from the batch: keep nothing rather than misalign
            return
        rows_t = torch.from_numpy(rows).to(hidden.device)
        tokens = input_ids[rows_t]
        states = hidden[rows_t]
        n = len(rows)
        stash = self._stash.get(op.req_id)
        predecessors = states[:-1]
        first_known = stash is not None and stash[0] == op.first_virtual - 1
        if first_known:
            predecessors = torch.cat([stash[1][None].to(states.dtype), predecessors])
        targets = tokens if first_known else tokens[1:]
        values = torch.full((n,), float("nan"), dtype=torch.float32)
        scored = self._surprisal(predecessors, targets)
        if scored is None:
            return
        values[n - len(scored):] = scored
        self._stash.pop(op.req_id, None)
        self._stash[op.req_id] = (op.first_virtual + n - 1, states[-1].detach().clone())
        if len(self._stash) > MAX_KEPT_REQUESTS:
            del self._stash[next(iter(self._stash))]
        keep = op.host_rows >= 0
        self._out_rows.append(op.host_rows[keep])
        self._out_values.append(values.numpy()[keep])
        self.recorded_tokens += int(keep.sum())

    def _surprisal(self, states: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """-log p(targets[i] | states[i]) for each row, float32 on the CPU."""
        out = []
        for c in range(0, len(states), CHUNK_TOKENS):
            logits = self.model.compute_logits(states[c:c + CHUNK_TOKENS])
            if logits is None:
                return None
            logp = torch.log_softmax(logits.float(), dim=-1)
            out.append(-logp.gather(1, targets[c:c + CHUNK_TOKENS, None].long())[:, 0])
        return torch.cat(out).cpu() if out else torch.zeros(0)
