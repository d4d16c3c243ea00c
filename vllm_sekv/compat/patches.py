"""Every place sekv changes vLLM's own code at run time, listed.

* `register_attention_hook`: the platform's attention backends in vLLM's
  backend registry point at sekv wrappers (`vllm_sekv.attention.backend`).
* `install_scheduler_default`: wraps `VllmConfig.__post_init__` so that the
  sekv connector flag also selects the sekv scheduler.
* `install_request_validation`: wraps `InputProcessor.process_inputs` so that
  invalid sekv request parameters are an HTTP 400 before the engine.
* `install_prompt_token_reuse`: wraps `HfRenderer.__init__` so that a sekv
  server's API server tokenizes a chat prompt that extends a recent one from
  the recent one's tokens (`vllm_sekv.prompt_tokens`).
* `hash_views_opaquely`: wraps the engine core's `get_request_block_hasher`
  so that requests served from views skip prefix-cache hashing.
* `size_kv_cache_for_views`: wraps the engine core's `get_kv_cache_configs`
  so that a sekv server's KV cache must hold the model's window, not its
  `max_model_len`.
* Scheduler surgery for execution views: `rewrite_request`,
  `hide_from_prefix_cache` and `restart_request` edit a vLLM `Request` and
  the scheduler's queues in place, as vLLM's streaming-session update does.

Each wrapper is installed once per process and passes everything through
for servers whose KV connector is not sekv.
"""
from __future__ import annotations

import hashlib
from typing import Any


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

SCHEDULER_CLS = "vllm_sekv.scheduler_side.engine_scheduler.SekvScheduler"

ASYNC_SCHEDULER_CLS = "vllm_sekv.scheduler_side.engine_scheduler.SekvAsyncScheduler"

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

def install_prompt_token_reuse(connector_name: str, reuse: Any) -> None:
    """Let a sekv server's API server tokenize only what is new in a prompt.

    Wraps `HfRenderer.__init__` (once per process; the class vLLM renders
    prompts with for Hugging Face tokenizers, in both versions; it renders a
    chat to text, then tokenizes the text with its tokenizer): a renderer of
    a server whose KV connector is `connector_name` calls `reuse(tokenizer)`
    on its own tokenizer object (the renderer copies the shared one), which
    changes how that object tokenizes a prompt, never what it returns."""
    from vllm.renderers.hf import HfRenderer

    original = HfRenderer.__init__
    if getattr(original, "_sekv_wrapped", False):
        return

    def __init__(self: Any, config: Any, tokenizer: Any, *args: Any, **kwargs: Any) -> None:
        original(self, config, tokenizer, *args, **kwargs)
        ktc = config.kv_transfer_config
        if ktc is not None and ktc.kv_connector == connector_name and self.tokenizer is not None:
            reuse(self.tokenizer)

    __init__._sekv_wrapped = True  # type: ignore[attr-defined]
    HfRenderer.__init__ = __init__

def size_kv_cache_for_views(connector_name: str, window_tokens: Any) -> None:
    """Let a sekv server's `max_model_len` exceed what its KV cache holds.

    vLLM refuses to start unless its KV cache holds one request of
    `max_model_len` tokens. A sekv server serves every prompt longer than its
    view budget from views, and no request of it holds more than the model's
    window on the device (views fit the window, generation is clamped to it):
    a session of a million tokens needs a cache of one window, not of a
    million tokens. Wraps `get_kv_cache_configs`, where the engine core sizes
    the cache and checks it (once per process; `vllm.v1.engine.core` binds the
    name at import, so it is replaced there too): for a server whose KV
    connector is `connector_name`, `max_model_len` reads
    `window_tokens(vllm_config)` for the call and is restored after it. A
    server that asks vLLM to fit `max_model_len` to its memory (`-1`) is left
    alone."""
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.engine import core

    original = kv_cache_utils.get_kv_cache_configs
    if getattr(original, "_sekv_wrapped", False):
        return

    def get_kv_cache_configs(vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        ktc, mc = vllm_config.kv_transfer_config, vllm_config.model_config
        ours = ktc is not None and ktc.kv_connector == connector_name
        if not ours or getattr(mc, "original_max_model_len", None) == -1:
            return original(vllm_config, *args, **kwargs)
        window = window_tokens(vllm_config)
        if mc.max_model_len <= window:
            return original(vllm_config, *args, **kwargs)
        held = mc.max_model_len
        mc.max_model_len = window
        try:
            return original(vllm_config, *args, **kwargs)
        finally:
            mc.max_model_len = held

    get_kv_cache_configs._sekv_wrapped = True  # type: ignore[attr-defined]
    kv_cache_utils.get_kv_cache_configs = get_kv_cache_configs
    if getattr(core, "get_kv_cache_configs", None) is original:
        core.get_kv_cache_configs = get_kv_cache_configs

# The pass salt of a request served from views (set by `rewrite_request` and
# `hide_from_prefix_cache`).
_VIEW_SALT = "_sekv_view_salt"

_OPAQUE_PREFIX = b"sekv-view-block\x00"

# The view admission test of the sekv scheduler built last in this process,
# for the engine core's block hasher built next (`hash_views_opaquely`).
_pending_admission: Any = None


def hash_views_opaquely(serves_from_views: Any) -> None:
    """Spare requests served from views vLLM's prefix-cache hashing.

    vLLM hashes every full block of a prompt when it creates the request (the
    engine core's `request_block_hasher`) and again whenever a connector
    rewrites it, a cost that grows with the history and is paid again by
    every pass of every agent step. A view job never uses those hashes:
    admission drops the prompt's, and each view pass carries a salt of its
    own, so no lookup can ever match them.

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
