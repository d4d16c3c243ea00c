"""The one CUDA runtime call torch does not expose: pitched (2D) async copies.

`copy2d_async(dst_ptr, dst_pitch_bytes, src_ptr, src_pitch_bytes, width_bytes,
height, stream)` enqueues `cudaMemcpy2DAsync` (kind `cudaMemcpyDefault`: the
direction follows from the pointers, UVA) on `stream` (a `torch.cuda.Stream`).
It moves `height` rows of `width_bytes` each in one DMA command, so one layer
of many consecutive host-pool slots (rows `slot_bytes` apart) reaches the
device in one call. Non-blocking when the host side is pinned.

The runtime is the libcudart torch already loaded in this process (found in
`/proc/self/maps`), so the call shares torch's context and streams. `available()`
is False where there is none (CPU-only installs); callers then keep to plain
torch copies. A failing call raises RuntimeError with CUDA's error string.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Any

_CUDA_MEMCPY_DEFAULT = 4


@functools.lru_cache(maxsize=1)
def _runtime() -> Any | None:
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        torch.cuda.init()
        with open("/proc/self/maps") as maps:
            loaded = sorted({line.split()[-1] for line in maps if "libcudart" in line})
    except (OSError, RuntimeError, ImportError):
        return None
    for name in (*loaded, "libcudart.so", "libcudart.so.13", "libcudart.so.12"):
        try:
            lib = ctypes.CDLL(name)
            fn = lib.cudaMemcpy2DAsync
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                       ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        return lib
    return None


def available() -> bool:
    """Whether pitched copies can be enqueued in this process."""
    return _runtime() is not None


def copy2d_async(dst_ptr: int, dst_pitch_bytes: int, src_ptr: int, src_pitch_bytes: int,
                 width_bytes: int, height: int, stream: Any) -> None:
    """Enqueue `height` rows of `width_bytes` from `src_ptr` (rows
    `src_pitch_bytes` apart) to `dst_ptr` (rows `dst_pitch_bytes` apart) on
    `stream`. The caller keeps both buffers alive until the stream passes it."""
    lib = _runtime()
    if lib is None:
        raise RuntimeError("sekv: no CUDA runtime in this process for pitched copies")
    err = lib.cudaMemcpy2DAsync(dst_ptr, dst_pitch_bytes, src_ptr, src_pitch_bytes, width_bytes,
                                height, _CUDA_MEMCPY_DEFAULT, stream.cuda_stream)
    if err:
        raise RuntimeError(f"sekv: cudaMemcpy2DAsync failed: {lib.cudaGetErrorString(err).decode()}")
