"""What this machine's vLLM build can run, for tests that skip what it cannot."""
from __future__ import annotations

FP8_CACHE_SKIP_REASON = "vLLM's CPU attention needs AVX-512 or AMX for an fp8 KV cache"


def cpu_attention_holds_fp8() -> bool:
    """Whether vLLM's CPU attention can keep an fp8 paged KV cache: it needs
    a processor with AVX-512 or AMX (an engine fails at start otherwise)."""
    import torch

    return torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()


def fp8_kv_cache_supported() -> bool:
    """Whether a vLLM engine here can start with `--kv-cache-dtype fp8`:
    on CUDA always, on the CPU build where its attention holds fp8."""
    import torch

    return torch.cuda.is_available() or cpu_attention_holds_fp8()
