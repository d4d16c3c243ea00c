"""The served model as the workspace sees it: its per-rank KV geometry, its
RoPE as a pure rotation, and the fingerprint stored KV must match.

Read from vLLM's config at start-up by both sides of the connector.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vllm_sekv.ops import RopeSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig


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
    from vllm_sekv.index.router import RouterGeometry

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

def model_fingerprint(vllm_config: "VllmConfig", block_tokens: int,
                      workspace_codec: str = "exact") -> dict[str, Any]:
    """What must match for stored KV to be valid for this server: the model
    (path or name, its config and its weights, `weights_digest`), KV dtype
    and geometry, block size, ranks, the record format, and the workspace
    codec (`workspace_codec`; named only when not exact, so exact
    fingerprints are unchanged): fp8 blocks are another server's KV, and
    so are the bytes of an fp8 paged cache (its dtype named too; its layer
    scales come with the weights)."""
    from vllm_sekv.store.records import FORMAT_VERSION

    mc = vllm_config.model_config
    geo = kv_geometry(vllm_config)
    load_format = str(getattr(vllm_config.load_config, "load_format", "auto"))
    fingerprint = {
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
    if workspace_codec != "exact":
        fingerprint["workspace_codec"] = workspace_codec
        cache_dtype = str(vllm_config.cache_config.cache_dtype)
        if cache_dtype.startswith("fp8"):  # the fp8 paged cache's own bytes, under its layer scales
            fingerprint["kv_cache_dtype"] = cache_dtype
    return fingerprint

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
