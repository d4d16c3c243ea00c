"""Reads and small writes of vLLM objects whose shape both supported versions
share (vLLM 0.26 on CUDA, 0.32 on CPU): registries, the forward context, the
scheduler's request records. Code elsewhere calls these instead of reaching
into vLLM; a field vLLM renames is fixed here.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def register_connector(name: str, module_path: str, class_name: str) -> None:
    """Register a KV connector under `name`; a no-op if it is already there.

    `KVConnectorFactory.register_connector` raises on a second registration, and
    vLLM runs plugin entry points more than once per process.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if name not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(name, module_path, class_name)

def attention_backend_base(wrapper_name: str) -> type | None:
    """`Sekv<Base>` -> the platform backend class `<Base>`, imported from the
    registry's default path (never through the registry, which now names the
    wrapper)."""
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    for member in AttentionBackendEnum:
        path = member.value
        if path and wrapper_name == "Sekv" + path.rsplit(".", 1)[1]:
            return resolve_obj_by_qualname(path)
    return None

def active_connector() -> Any | None:
    """The worker-side KV connector of this process, or None."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return get_kv_transfer_group() if has_kv_transfer_group() else None

def layer_index(layer_name: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(layer_name)

def attention_layer(forward_context: Any, layer_name: str) -> Any:
    """The `Attention` module named `layer_name` in the current forward pass."""
    return forward_context.no_compile_layers[layer_name]

def paged_kv_views(kv_cache: Any, kv_heads: int, head_dim: int) -> tuple[Any, Any] | None:
    """(K, V) views `[pages, page_size, kv_heads, head_dim]` of one layer's
    paged cache, as the platform's cache-update op writes it, for the layouts
    of vLLM's GPU attention backends; None for any other (the CPU backend's
    among them; the worker then captures K/V through the attention hook):

    * vLLM 0.26's FlashAttention: K and V packed in the content dim, logical
      `[pages, kv_heads, page_size, 2 * head_dim]` (its `do_kv_cache_update`
      writes `kv_cache.transpose(1, 2).split(head_dim, -1)`);
    * `[2, pages, page_size, kv_heads, head_dim]` (FlashAttention before it)
      and `[pages, 2, page_size, kv_heads, head_dim]` (FlashInfer).

    Any stride order. The worker checks the views against the attention
    layer's own K/V once before trusting them (`StepCapture.gather`)."""
    shape = tuple(kv_cache.shape)
    if kv_cache.dim() == 4 and shape[1] == kv_heads and shape[3] == 2 * head_dim:
        key, value = kv_cache.transpose(1, 2).split(head_dim, dim=-1)
        return key, value
    if kv_cache.dim() != 5 or shape[3:] != (kv_heads, head_dim):
        return None
    if shape[0] == 2:
        return kv_cache[0], kv_cache[1]
    if shape[1] == 2:
        return kv_cache[:, 0], kv_cache[:, 1]
    return None

def paged_kv_byte_views(kv_cache: Any, kv_heads: int, head_dim: int) -> tuple[Any, Any] | None:
    """(K, V) uint8 views `[pages, page_size, kv_heads, head_dim]` of one
    layer's fp8 paged cache (one byte per element), as the platform's
    cache-update op writes it: on CUDA the layouts of `paged_kv_views`; on
    the CPU vLLM 0.32's backend as its `vec` kernels write it, each (page,
    head) `2 * page_size * head_dim` bytes (registered as `[pages, kv_heads,
    page_size, 2 * head_dim]`), its K head_dim-major (`[head_dim,
    page_size]`) and its V token-major after it. None for any other. The CPU
    layout depends on the kernels (`amx` packs K otherwise): the worker
    checks the views against the attention layer's own K/V once before
    trusting them (`ForwardCapture.first_layer`)."""
    import torch

    if kv_cache.element_size() != 1:
        return None
    cache = kv_cache.view(torch.uint8)
    if cache.device.type != "cpu":
        return paged_kv_views(cache, kv_heads, head_dim)
    shape = tuple(cache.shape)
    if cache.dim() != 4 or shape[1] != kv_heads or not cache[0, 0].is_contiguous():
        return None
    pages, page_size = shape[0], shape[2] * shape[3] // (2 * head_dim)
    if page_size * 2 * head_dim != shape[2] * shape[3]:
        return None
    page, head = cache.stride(0), cache.stride(1)
    at = cache.storage_offset()
    key = cache.as_strided((pages, page_size, kv_heads, head_dim), (page, 1, head, page_size), at)
    value = cache.as_strided((pages, page_size, kv_heads, head_dim), (page, head_dim, head, 1),
                             at + page_size * head_dim)
    return key, value

def kv_cache_scales(vllm_config: "VllmConfig", layer_names: list[str]) -> list[tuple[float, float]]:
    """(K scale, V scale) of each named attention layer, as its cache-update
    op applies them to an fp8 paged cache (1.0 unless the checkpoint gives
    scales; fixed once the weights are loaded)."""
    layers = vllm_config.compilation_config.static_forward_context
    return [(float(layers[name]._k_scale_float), float(layers[name]._v_scale_float)) for name in layer_names]

def kv_update_replayed_from_cuda_graphs(vllm_config: "VllmConfig") -> bool:
    """Whether vLLM would replay the attention layers' KV-cache update from
    captured CUDA graphs, where the attention hook (Python) never runs: graphs
    are captured and the update op is not among the ops vLLM keeps out of
    them (`compilation_config.splitting_ops`; with Inductor graph partition it
    never is). vLLM's defaults (0.26, 0.32) keep it out; the CPU captures no
    graphs."""
    cc = vllm_config.compilation_config
    mode = cc.cudagraph_mode  # None until vLLM resolves it (it has by the time a connector starts)
    if mode is None or mode.name == "NONE" or not (cc.cudagraph_capture_sizes or []):
        return False
    return not cc.splitting_ops_contain_kv_cache_update()

def kv_cache_block_size(vllm_config: "VllmConfig") -> int:
    return vllm_config.cache_config.block_size

def request_cache_salt(request: Any) -> str:
    return getattr(request, "cache_salt", None) or ""

def new_request_block_ids(new_req: Any) -> list[int]:
    """Block ids of the first (only) KV-cache group of a `NewRequestData`."""
    return list(new_req.block_ids[0])

def cached_request_updates(cached: Any) -> list[tuple[str, list[int] | None, bool]]:
    """(req_id, new block ids of group 0 or None, replaces_all) per cached request."""
    resumed = getattr(cached, "resumed_req_ids", set()) or set()
    out = []
    for i, req_id in enumerate(cached.req_ids):
        new_ids = cached.new_block_ids[i]
        out.append((req_id, None if new_ids is None else list(new_ids[0]), req_id in resumed))
    return out

def worker_rank() -> int:
    """This worker's tensor-parallel rank (which share of each block it holds)."""
    from vllm.distributed import get_tensor_model_parallel_rank

    try:
        return get_tensor_model_parallel_rank()
    except AssertionError:  # no parallel state (e.g. a bare test process)
        return 0

def native_window_tokens(vllm_config: "VllmConfig") -> int:
    """The longest sequence the model was trained for: `max_position_embeddings`
    (capped by `max_model_len` when that is smaller). Views never exceed it,
    even when `--max-model-len` was raised to accept longer prompts."""
    mc = vllm_config.model_config
    native = getattr(mc.hf_text_config, "max_position_embeddings", None) or mc.max_model_len
    return min(int(native), int(mc.max_model_len))

def load_tokenizer(vllm_config: "VllmConfig") -> Any:
    """The served model's tokenizer (Hugging Face), as vLLM's model config names it."""
    from transformers import AutoTokenizer

    model = vllm_config.model_config
    return AutoTokenizer.from_pretrained(model.tokenizer, revision=model.tokenizer_revision,
                                         trust_remote_code=model.trust_remote_code)

def kv_capacity_tokens(kv_cache_config: Any, vllm_config: "VllmConfig") -> int:
    """Tokens the paged KV cache holds (one request's upper bound)."""
    if kv_cache_config is None:
        return vllm_config.model_config.max_model_len
    return int(kv_cache_config.num_blocks) * kv_cache_block_size(vllm_config)

def clamp_max_tokens(request: Any, most: int) -> None:
    """Generate at most `most` tokens (at least one)."""
    request.max_tokens = max(1, min(int(request.max_tokens), int(most)))

def is_known_request(scheduler: Any, request: Any) -> bool:
    """Whether the scheduler already holds a request of this id (a streaming
    session's next input arrives as a request with the same id)."""
    return request.request_id in scheduler.requests

def finished_tokens(request: Any) -> int:
    """How many of the request's tokens have KV computed by a step whose
    output the scheduler has processed. Under asynchronous scheduling vLLM
    advances `num_computed_tokens` when it schedules a step, one step before
    that step's output comes back; both 0.26 and 0.32 count the tokens of
    steps still running in `num_in_flight_tokens`."""
    return request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
