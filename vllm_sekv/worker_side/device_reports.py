"""What the device tells a step's report after the step's host code has moved on.

Under asynchronous scheduling the worker builds a step's report
(`SekvWorkerMeta`) while the step still runs on the GPU, and vLLM prepares
the next step right after. Waiting there for the GPU would hold that back, so
these facts travel in the report unread:

* `RestoreTiming`: a restore's transfer time, two CUDA events;
* `CaptureCheck`: whether a paged capture's planned slots were in its step's
  batch, flags computed on the device and copied to pinned host memory;
* `SlotCheck` in general: flags per slot from the device, e.g. whether an fp8
  capture's blocks were finite (`store.fp8_capture`), copied behind the
  capture's own copies on their stream.

`SekvWorkerMeta.settled()` reads them when the scheduler side reads the report.
vLLM hands a step's report over with the step's output, once its sampled
tokens are on the host: the forward, which waited for every restored layer,
has then run, so the timing is ready, and a check waits at most for the
capture's own kernels behind it (a few microseconds for a batch check; an fp8
capture's quantization and copies, which the forward no longer waits for).
Read earlier, they wait; they are never read wrong. Each is idempotent: read
once, remembered.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch


class RestoreTiming:
    """A restore's transfer time (`end - start`, CUDA timing events around
    its copies), split between the requests it served by their share of its
    blocks."""

    def __init__(self, start: Any, end: Any, shares: list[tuple[str, float]]) -> None:
        self.start, self.end = start, end
        self.shares = shares
        self._seconds: float | None = None

    def ready(self) -> bool:
        """Whether the copies are done (never waits)."""
        return self._seconds is not None or self.end.query()

    def seconds(self) -> float:
        """The transfer time; waits for the last copy if it still runs."""
        if self._seconds is None:
            self.end.synchronize()
            self._seconds = self.start.elapsed_time(self.end) / 1000.0
        return self._seconds

    def apply(self, restore_seconds: dict[str, float], failed_slots: set[int]) -> None:
        """Fold into a report: each request's share of the time."""
        seconds = self.seconds()
        for req_id, share in self.shares:
            restore_seconds[req_id] = restore_seconds.get(req_id, 0.0) + seconds * share


# Up to this many (planned slot, batch slot) pairs, `in_batch` compares all of
# them at once (two launches, a decode step's case); beyond, it sorts.
_PAIRWISE_MAX = 1 << 20


def in_batch(want: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """`[len(want)]` bool: which of the paged slots `want` the step's
    `slot_mapping` writes. On the device, without a synchronization."""
    if not len(slot_mapping):
        return torch.zeros(len(want), dtype=torch.bool, device=want.device)
    if len(want) * len(slot_mapping) <= _PAIRWISE_MAX:
        return (want[:, None] == slot_mapping[None, :]).any(dim=1)
    ordered = torch.sort(slot_mapping.to(torch.int64)).values
    at = torch.searchsorted(ordered, want).clamp_(max=len(ordered) - 1)
    return ordered[at] == want


class SlotCheck:
    """A flag per planned row, computed on the device: where one is False its
    host slot fails (`why` says why). The flags are copied to pinned memory
    behind an event recorded on `stream` (default: the current one):
    building the check never waits for the GPU."""

    def __init__(self, ok: torch.Tensor, host_slots: np.ndarray, why: str, stream: Any = None) -> None:
        self.host_slots = host_slots  # per row
        self.why = why
        if ok.device.type == "cuda":
            stream = stream if stream is not None else torch.cuda.current_stream(ok.device)
            self._flags = torch.empty(len(host_slots), dtype=torch.bool, pin_memory=True)
            with torch.cuda.stream(stream):
                self._flags.copy_(ok, non_blocking=True)
            self._done: Any = torch.cuda.Event()
            self._done.record(stream)
        else:
            self._flags, self._done = ok, None
        self._failed: set[int] | None = None

    def ready(self) -> bool:
        """Whether the flags are on the host (never waits)."""
        return self._failed is not None or self._done is None or self._done.query()

    def failed(self) -> set[int]:
        """Host slots with a row whose flag is False; waits for the flags if
        they are still on their way."""
        if self._failed is None:
            if self._done is not None:
                self._done.synchronize()
            self._failed = set(np.unique(self.host_slots[~self._flags.numpy()]).tolist())
        return self._failed

    def apply(self, restore_seconds: dict[str, float], failed_slots: set[int]) -> None:
        """Fold into a report: the failed host slots."""
        failed_slots |= self.failed()


class CaptureCheck(SlotCheck):
    """Whether each planned row of a paged capture was in its step's batch.

    A paged capture reads its rows from the paged cache at the plan's paged
    slots; a slot the step did not write holds older KV, so its host slot
    must fail instead of being committed (`in_batch`, on the compute stream)."""

    def __init__(self, want: torch.Tensor, slot_mapping: torch.Tensor, host_slots: np.ndarray) -> None:
        super().__init__(in_batch(want, slot_mapping), host_slots, "rows missing from the batch")


def count_settled(facts: list, stats: Any, capture: Any, wait: bool = False) -> list:
    """Count the device facts that are in (with `wait`: every one, waiting
    for them) into `stats` (restore seconds) and `capture` (slots of a check
    that failed: dropped blocks, with the check's `why`; the report carries
    the slots, here they are only counted); returns the facts still on the
    device, for a later step."""
    waiting = []
    for fact in facts:
        if not (wait or fact.ready()):
            waiting.append(fact)
        elif isinstance(fact, RestoreTiming):
            stats.add("restore_seconds", fact.seconds())
        elif fact.failed():
            capture.count_dropped(len(fact.failed()), fact.why)
    return waiting

