"""CUDA runtime calls torch does not expose the way sekv needs them.

`copy2d_async(dst_ptr, dst_pitch_bytes, src_ptr, src_pitch_bytes, width_bytes,
height, stream)` enqueues `cudaMemcpy2DAsync` (kind `cudaMemcpyDefault`: the
direction follows from the pointers, UVA) on `stream` (a `torch.cuda.Stream`).
It moves `height` rows of `width_bytes` each in one DMA command, so one layer
of many consecutive host-pool slots (rows `slot_bytes` apart) reaches the
device in one call. Non-blocking when the host side is pinned.

`register_host(ptr, nbytes)` page-locks (pins) an existing host allocation of
exactly `nbytes` (`cudaHostRegister`), `unregister_host(ptr)` undoes it, and
`is_page_locked(tensor)` tells either kind of pinned memory apart. Torch's
`pin_memory=True` goes through its caching host allocator, which rounds every
allocation up to a power of two: a 66 GiB host tier would pin 128 GiB.

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
_CUDA_HOST_REGISTER_DEFAULT = 0
_CUDA_MEMORY_TYPE_HOST = 1


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
        lib.cudaHostRegister.restype = ctypes.c_int
        lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cudaHostUnregister.restype = ctypes.c_int
        lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        lib.cudaPointerGetAttributes.restype = ctypes.c_int
        lib.cudaPointerGetAttributes.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        return lib
    return None


def available() -> bool:
    """Whether these calls can be made in this process."""
    return _runtime() is not None


def _lib() -> Any:
    lib = _runtime()
    if lib is None:
        raise RuntimeError("sekv: no CUDA runtime in this process")
    return lib


def _check(lib: Any, err: int, call: str) -> None:
    if err:
        raise RuntimeError(f"sekv: {call} failed: {lib.cudaGetErrorString(err).decode()}")


def register_host(ptr: int, nbytes: int) -> None:
    """Page-lock `nbytes` of host memory at `ptr` for DMA (every page is
    touched and locked now; expect seconds per tens of GiB)."""
    lib = _lib()
    _check(lib, lib.cudaHostRegister(ptr, nbytes, _CUDA_HOST_REGISTER_DEFAULT), f"cudaHostRegister of {nbytes} bytes")


def unregister_host(ptr: int) -> None:
    """Undo `register_host(ptr, ...)`."""
    lib = _lib()
    _check(lib, lib.cudaHostUnregister(ptr), "cudaHostUnregister")


def is_page_locked(tensor: Any) -> bool:
    """Whether a host tensor's memory is pinned, by torch's allocator or by
    `register_host` (torch's `is_pinned` knows only its own allocations)."""
    if tensor.is_pinned():
        return True
    lib = _runtime()
    if lib is None or tensor.device.type != "cpu":
        return False
    # struct cudaPointerAttributes: the memory type (enum, int) comes first;
    # the buffer is larger than any version of the struct.
    attrs = (ctypes.c_int * 32)()
    if lib.cudaPointerGetAttributes(ctypes.addressof(attrs), tensor.data_ptr()):
        return False
    return attrs[0] == _CUDA_MEMORY_TYPE_HOST


def copy2d_async(dst_ptr: int, dst_pitch_bytes: int, src_ptr: int, src_pitch_bytes: int,
                 width_bytes: int, height: int, stream: Any) -> None:
    """Enqueue `height` rows of `width_bytes` from `src_ptr` (rows
    `src_pitch_bytes` apart) to `dst_ptr` (rows `dst_pitch_bytes` apart) on
    `stream`. The caller keeps both buffers alive until the stream passes it."""
    lib = _lib()
    err = lib.cudaMemcpy2DAsync(dst_ptr, dst_pitch_bytes, src_ptr, src_pitch_bytes, width_bytes,
                                height, _CUDA_MEMCPY_DEFAULT, stream.cuda_stream)
    _check(lib, err, "cudaMemcpy2DAsync")
