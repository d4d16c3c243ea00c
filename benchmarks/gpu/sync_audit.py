"""Which code makes the host wait for the GPU: every synchronizing CUDA
operation PyTorch flags (`torch.cuda.set_sync_debug_mode("warn")`: a stream
or device synchronize, a blocking copy, `.item()`, `.cpu()`, `nonzero`, a
host->device copy of pageable memory without `non_blocking`), counted by
where it was called from.

A synchronization inside a decode step costs the step its overlap with the
next one (vLLM schedules the next step while the GPU runs this one): the step
then takes host time + GPU time instead of the larger of the two. vLLM makes
some of its own (the sampled tokens reach the host once per step); this
counts them apart from the ones a sekv frame is on the stack of.

`install()` turns PyTorch's sync debug mode on (process-wide) and routes its
warnings here; `snapshot()` / `diff(a, b)` read the counts, keyed
`"<sekv|vllm|other>: file:line in function"` by the innermost frame of that
owner (sekv frames win over vLLM frames). Each flagged call costs a stack
walk (tens of microseconds): for finding synchronizations, not for timing.
"""
from __future__ import annotations

import collections
import traceback
import warnings

_COUNTS: collections.Counter = collections.Counter()
_MESSAGE = "synchronizing CUDA operation"


def _where(stack: list[traceback.FrameSummary]) -> str:
    """The innermost sekv frame, else the innermost vLLM one, else the caller."""
    for owner, marker in (("sekv", "vllm_sekv/"), ("vllm", "vllm/")):
        for frame in reversed(stack):
            if marker in frame.filename:
                path = frame.filename.split(marker, 1)[1]
                return f"{owner}: {marker}{path}:{frame.lineno} in {frame.name}"
    frame = stack[-1] if stack else None
    return f"other: {frame.filename}:{frame.lineno} in {frame.name}" if frame else "other: ?"


def install() -> None:
    """Count every synchronizing CUDA operation from now on (other warnings
    go to the handler that was in place)."""
    import torch

    shown = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if _MESSAGE in str(message):
            stack = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith("warnings.py")]
            _COUNTS[_where(stack)] += 1
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning
    warnings.filterwarnings("always", message=f".*{_MESSAGE}.*")
    torch.cuda.set_sync_debug_mode("warn")


def snapshot() -> dict[str, int]:
    return dict(_COUNTS)


def diff(before: dict[str, int], after: dict[str, int], per: int = 1) -> dict[str, float]:
    """Synchronizations per `per` steps between two snapshots, by place."""
    return {where: (n - before.get(where, 0)) / per for where, n in after.items() if n > before.get(where, 0)}


def table(counts: dict[str, float], title: str) -> list[str]:
    """A Markdown table of `counts` (most first); says so when there are none."""
    if not counts:
        return [title, "", "None."]
    lines = [title, "", "| where | synchronizations |", "|---|---|"]
    for where, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        lines.append(f"| `{where}` | {n:g} |")
    return lines
