"""Everything in vllm-sekv that touches vLLM's internals, in three modules:

* `engine_access`: reads and small writes of vLLM objects both supported
  versions share;
* `versions`: what differs between vLLM 0.26 (CUDA) and 0.32 (CPU build),
  decided once;
* `patches`: every run-time change to vLLM's own code, listed.

A new vLLM version means editing this package only. Callers use
`from vllm_sekv import compat` and `compat.<name>`.
"""
from vllm_sekv.compat.engine_access import (
    active_connector,
    attention_backend_base,
    attention_layer,
    cached_request_updates,
    clamp_max_tokens,
    finished_tokens,
    is_known_request,
    kv_cache_block_size,
    kv_cache_scales,
    kv_capacity_tokens,
    kv_update_replayed_from_cuda_graphs,
    layer_index,
    load_tokenizer,
    native_window_tokens,
    new_request_block_ids,
    paged_kv_byte_views,
    paged_kv_views,
    register_connector,
    request_cache_salt,
    worker_rank,
)
from vllm_sekv.compat.patches import (
    hash_views_opaquely,
    hide_from_prefix_cache,
    install_prompt_token_reuse,
    install_request_validation,
    install_scheduler_default,
    register_attention_hook,
    restart_request,
    rewrite_request,
    sekv_scheduler_cls,
    size_kv_cache_for_views,
)
from vllm_sekv.compat.versions import full_graph_replay, full_graph_slot_mapping, model_of_caller, prefill_cap_mixin

__all__ = [
    "active_connector", "attention_backend_base", "attention_layer", "cached_request_updates", "clamp_max_tokens",
    "finished_tokens", "full_graph_replay", "full_graph_slot_mapping", "hash_views_opaquely",
    "hide_from_prefix_cache", "install_prompt_token_reuse", "install_request_validation", "install_scheduler_default",
    "is_known_request", "kv_cache_block_size", "kv_cache_scales", "kv_capacity_tokens",
    "kv_update_replayed_from_cuda_graphs", "layer_index", "model_of_caller", "native_window_tokens",
    "new_request_block_ids", "paged_kv_byte_views", "paged_kv_views", "prefill_cap_mixin", "register_attention_hook",
    "register_connector", "request_cache_salt", "restart_request", "rewrite_request", "sekv_scheduler_cls",
    "size_kv_cache_for_views", "worker_rank",
]
