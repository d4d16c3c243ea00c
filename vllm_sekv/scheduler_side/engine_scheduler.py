"""The scheduler hook: vLLM's `Scheduler`, extended to serve execution views.

Selected by the sekv connector flag alone (`compat.install_scheduler_default`):
`SekvScheduler` when vLLM schedules synchronously, `SekvAsyncScheduler` (the
same hooks over vLLM's `AsyncScheduler`) when it schedules a step while the
last one runs. The hooks hold in both modes: a pass that must not sample is
never scheduled past its end (its cap is 0 once its tokens are scheduled),
and it leaves the engine only once the step computing its last chunk has
come back (`compat.finished_tokens`: under asynchronous scheduling vLLM
counts a step's tokens as computed when it schedules them). The connector's
plans use the positions vLLM schedules, and commit a captured block only
once the worker confirms the step that wrote it.
Everything view-specific is decided by the connector's `ViewCoordinator`;
this class only places the three calls vLLM's scheduler offers no hook for:

* `add_request`: a prompt longer than its view budget becomes a view job
  (and every request's generation stays inside the model's window); vLLM's
  prefix-cache hashing spares view jobs (`compat.hash_views_opaquely`);
* the per-request cap on a step's prefill tokens (`compat.prefill_cap_mixin`):
  a pass that must not sample stops one token short of its end;
* `update_from_output`: a finished non-sampling pass leaves the engine and
  is queued again, to be rewritten into its next pass when scheduled.

Without the sekv connector it behaves exactly like `Scheduler`.
"""
from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_sekv import compat


class SekvScheduler(compat.prefill_cap_mixin(), Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._views = getattr(self.connector, "views", None)
        if self._views is not None:
            self._sekv_enable_cap()
            compat.hash_views_opaquely(self._views.serves_from_views)

    def add_request(self, request: Any) -> None:
        if self._views is not None and not compat.is_known_request(self, request):
            self._views.admit(request)
        super().add_request(request)

    def _sekv_cap(self, request: Any, num_computed_tokens: int, num_new_tokens: int) -> int:
        if self._views is None:
            return num_new_tokens
        return self._views.max_new_tokens(request, num_computed_tokens, num_new_tokens)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self._views is not None:
            for request in self._views.passes_done(list(self.running)):
                compat.restart_request(self, request)
                self.connector.view_pass_done(request)
        return outputs


class SekvAsyncScheduler(SekvScheduler, AsyncScheduler):
    """`SekvScheduler` over vLLM's `AsyncScheduler` (asynchronous scheduling)."""
