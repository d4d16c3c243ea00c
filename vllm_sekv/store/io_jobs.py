"""Jobs on a pool of I/O threads whose results the forward thread collects
without waiting: the NVMe and remote tiers' reads and writes.

`submit` returns at once; `drain()` returns the results of the jobs finished
so far, in submission order among them (with `wait`, of every job). Each job
returns a list of results (one per record it moved). Not thread-safe: submit
and drain from one thread.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable


class IoJobs:
    def __init__(self, threads: int, name: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
        self._futures: list[Future] = []

    def submit(self, job: Callable[..., list], *args: Any) -> None:
        self._futures.append(self._executor.submit(job, *args))

    def drain(self, wait: bool = False) -> list:
        done, pending = [], []
        for fut in self._futures:
            if wait or fut.done():
                done += fut.result()
            else:
                pending.append(fut)
        self._futures = pending
        return done

    def close(self) -> None:
        """Wait for every job, then stop the threads."""
        self._executor.shutdown(wait=True)
