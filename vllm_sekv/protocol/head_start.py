"""A restore's head start: its first copies enqueued when the step is planned.

A step's restore copies start, in the worker, at `start_load_kv`. Between the
scheduler side planning the step (`build_connector_meta`) and that call, vLLM
finishes scheduling and prepares the step's inputs, milliseconds for a
long follow-up, every one of them added to its time to first token. When the worker lives in the scheduler's process (vLLM's single-GPU
engine core: one process, one thread, the worker called in line), the
scheduler side hands it the plan right away (`offer`), and the worker enqueues
the restore's first layers then (`SekvWorkerSide.head_start`); its
`start_load_kv` adopts them. A worker in another process (tensor parallel,
multiprocess executors) is never found here: its restores start as before.

Earlier still, when `get_num_new_matched_tokens` matches a restore, the
scheduler side hands over the host slots it will read (`offer_match`): the
copies begin before vLLM allocates the request's blocks (which grows with
the prompt's length), and the plan of the same step claims them
if it restores exactly those slots (`SekvWorkerSide.head_start_match`).

Workers register under their engine's `kv_transfer_config.engine_id`, which
both sides of one engine share; nothing crosses a process.
"""
from __future__ import annotations

import weakref
from typing import Any

_WORKERS: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()


def engine_id(vllm_config: Any) -> str | None:
    """The key both sides of one engine share (None: no head starts)."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    return getattr(transfer, "engine_id", None)


def register(engine: str | None, worker: Any) -> None:
    """`worker` (a `SekvWorkerSide` with its caches registered) takes head
    starts for engine `engine`'s plans, until `unregister` or its collection."""
    if engine is not None:
        _WORKERS[engine] = worker


def unregister(engine: str | None, worker: Any) -> None:
    if engine is not None and _WORKERS.get(engine) is worker:
        del _WORKERS[engine]


def has_worker(engine: str | None) -> bool:
    """Whether engine `engine`'s worker takes head starts in this process."""
    return engine is not None and engine in _WORKERS


def offer_match(engine: str | None, host_slots: Any) -> None:
    """Hand the host slots of a restore just matched (and not yet scheduled)
    to engine `engine`'s worker, if it runs in this process."""
    worker = _WORKERS.get(engine) if engine is not None else None
    if worker is not None:
        worker.head_start_match(host_slots)


def offer(engine: str | None, plan: Any) -> None:
    """Hand a just-built step plan to engine `engine`'s worker, if it runs in
    this process (a no-op otherwise)."""
    worker = _WORKERS.get(engine) if engine is not None else None
    if worker is not None:
        worker.head_start(plan)
