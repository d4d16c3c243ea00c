"""Loader of the native batched host->device copy (`csrc/batched_copy.cpp`).

`load()` compiles the source on first use with torch's C++ extension loader
(cached under TORCH_EXTENSIONS_DIR) and returns the module, or None when
there is no CUDA, no compiler, the build fails, or SEKV_NATIVE_COPY=0; callers
then use torch's copies. Blocking (the first call may compile for about a
minute); thread-safe; never raises for a missing toolchain.
"""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
SOURCE_NAME = "batched_copy.cpp"


def _source_path() -> Path | None:
    try:
        from importlib.resources import files

        path = Path(str(files("vllm_sekv._csrc") / SOURCE_NAME))
        if path.is_file():
            return path
    except (ImportError, ModuleNotFoundError, TypeError):
        pass
    path = Path(__file__).resolve().parents[2] / "csrc" / SOURCE_NAME  # source checkout
    return path if path.is_file() else None


@functools.lru_cache(maxsize=1)
def load():
    """The compiled module (with `h2d_runs(dst, src, runs[n,3] int64, stream_ptr)`) or None."""
    if os.environ.get("SEKV_NATIVE_COPY", "1") == "0" or not torch.cuda.is_available():
        return None
    source = _source_path()
    if source is None:
        logger.info("native copy source not found; using torch copies")
        return None
    try:
        from torch.utils.cpp_extension import load as load_extension

        return load_extension(name="sekv_batched_copy", sources=[str(source)], with_cuda=True,
                              extra_cflags=["-O2"], verbose=False)
    except Exception as exc:  # no compiler, no CUDA headers, build error
        logger.warning("native copy unavailable (%s); using torch copies", exc)
        return None
