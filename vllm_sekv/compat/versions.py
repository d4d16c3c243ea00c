"""What differs between the supported vLLM versions, decided here once.

* vLLM 0.32 (the CPU build) caps a request's prefill chunk through
  `Scheduler._reserve_prefill_lookahead`; 0.26 has no such hook, and sekv
  uses the Mamba block-aligned split, called at the same two places
  (`prefill_cap_mixin`).
* A full-CUDA-graph step: 0.32 marks its forward context FULL and keeps the
  slot mapping there; 0.26's V2 runner starts such a step's KV loads outside
  any forward context and keeps the mapping in a persistent buffer
  (`full_graph_replay`, `full_graph_slot_mapping`).
* The loaded model is reached from `register_kv_caches`'s caller, which is
  0.32's model runner directly and 0.26's through `ActiveKVConnector`
  (`model_of_caller`).
"""
from __future__ import annotations

from typing import Any

import torch


def model_of_caller() -> Any | None:
    """The loaded model, found from inside `register_kv_caches`.

    vLLM hands KV connectors no handle on the model. `register_kv_caches` is
    called (directly in 0.32's runner, through `ActiveKVConnector` in 0.26's
    V2 runner) from the model runner's `initialize_kv_cache`, whose `self.model`
    is the loaded model: the nearest frame up the stack whose `self` has a
    `model` with `compute_logits`. None if there is none."""
    import inspect

    frame = inspect.currentframe()
    try:
        while frame is not None:
            owner = frame.f_locals.get("self")
            model = getattr(owner, "model", None)
            if isinstance(model, torch.nn.Module) and callable(getattr(model, "compute_logits", None)):
                return model
            frame = frame.f_back
        return None
    finally:
        del frame

def full_graph_replay(forward_context: Any) -> bool:
    """Whether this step's forward replays a full CUDA graph, where no Python
    runs between its layers (no attention hook, no `wait_for_layer_load`).
    vLLM 0.26's model runner (V2) starts the KV loads of such a step outside
    any forward context (no attention metadata); vLLM 0.32's marks the
    context FULL. Steps without a forward have no metadata either, and
    nothing for a hook to do."""
    if getattr(forward_context, "attn_metadata", None) is None:
        return True
    mode = getattr(forward_context, "cudagraph_runtime_mode", None)
    return getattr(mode, "name", None) == "FULL"

def full_graph_slot_mapping(forward_context: Any, seen: Any, num_tokens: int) -> Any | None:
    """The slot mapping (paged slot of each batch row) of a step that replays
    a full CUDA graph, its first `num_tokens` rows; None if not at hand.

    vLLM 0.32 keeps it in the forward context (per layer; sekv's layers share
    one KV-cache group). vLLM 0.26 (V2 runner) has no context there: the graph
    reads the mapping from the persistent buffer it was captured with, which
    the runner fills before every forward, piecewise or full, and pads with
    -1 past the batch. `seen` is a mapping an attention layer was handed in
    an earlier step, a view into that buffer; this reads the buffer from the
    same place, on the stream, so after this step's fill."""
    by_layer = getattr(forward_context, "slot_mapping", None)
    if isinstance(by_layer, dict) and by_layer:
        return next(iter(by_layer.values()))[:num_tokens]
    if seen is None or seen.dim() != 1:
        return None
    room = seen.untyped_storage().nbytes() // seen.element_size() - seen.storage_offset()
    if num_tokens > room:
        return None
    return seen.as_strided((num_tokens,), (seen.stride(0),), seen.storage_offset())

def prefill_cap_mixin() -> type:
    """A mixin for `Scheduler` subclasses: every prefill chunk vLLM schedules
    (running and waiting requests alike) goes through
    `self._sekv_cap(request, num_computed_tokens, num_new_tokens) -> int`.

    vLLM 0.32 has a per-request hook for this, `_reserve_prefill_lookahead`.
    vLLM 0.26 has none but `_mamba_block_aligned_split`, called at the same
    two places when `need_mamba_block_aligned_split` is set; the mixin sets
    the flag (`_sekv_enable_cap`) and calls vLLM's split only for models that
    needed it.
    """
    from vllm.v1.core.sched.scheduler import Scheduler

    if hasattr(Scheduler, "_reserve_prefill_lookahead"):

        class _PrefillCap:
            def _sekv_enable_cap(self) -> None:
                pass

            def _reserve_prefill_lookahead(self, request, num_computed_tokens, num_new_tokens):
                n = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
                return self._sekv_cap(request, num_computed_tokens, n)

        return _PrefillCap

    class _PrefillCap:  # vLLM 0.26
        def _sekv_enable_cap(self) -> None:
            self._sekv_native_split = self.need_mamba_block_aligned_split
            self.need_mamba_block_aligned_split = True

        def _mamba_block_aligned_split(self, request, num_new_tokens,
                                       num_new_local_computed_tokens=0,
                                       num_external_computed_tokens=0):
            n = num_new_tokens
            if getattr(self, "_sekv_native_split", True):
                n = super()._mamba_block_aligned_split(
                    request, n, num_new_local_computed_tokens, num_external_computed_tokens)
            computed = (request.num_computed_tokens + num_new_local_computed_tokens
                        + num_external_computed_tokens)
            return self._sekv_cap(request, computed, n)

    return _PrefillCap
