"""`vllm-sekv model prepare [NAME] [--dest DIR] [--parts-dir DIR] [--no-install]`.

Calls `vllm_sekv.models.prepare_model` and prints the prepared folder. Exit
status 1, with the reason on stderr, when the model's parts are missing or
invalid or NAME is not a bundled model.
"""
from __future__ import annotations

import argparse
import sys

from vllm_sekv.models import (BUNDLED, DEFAULT_MODEL, PARTS_ENV, ModelPackageMissing, ModelPartsInvalid,
                              prepare_model)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("model", help="prepare a bundled model once",
                                   description="Bundled models: real models that install offline.")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    prep = actions.add_parser(
        "prepare", help="convert a bundled model once; print its folder",
        description="Find (or install) the packages holding a bundled model's GGUF, join and check them, "
                    "convert them once into a Hugging Face folder vLLM serves, and print that folder.")
    prep.add_argument("name", nargs="?", default=DEFAULT_MODEL, metavar="NAME",
                      help="bundled model: " + ", ".join(m.aliases[0] for m in BUNDLED) + " (default: %(default)s)")
    prep.add_argument("--dest", default=None, metavar="DIR",
                      help="target folder (default: under $SEKV_CACHE_DIR, else ~/.cache/vllm-sekv)")
    prep.add_argument("--parts-dir", default=None, metavar="DIR",
                      help=f"a folder holding the model's part files (default: ${PARTS_ENV}; "
                           "else the installed packages)")
    prep.add_argument("--no-install", action="store_true", help="never pip-install missing packages")
    prep.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        print(prepare_model(args.name, args.dest, parts_dir=args.parts_dir, install=not args.no_install))
    except (ModelPackageMissing, ModelPartsInvalid, ValueError) as e:
        print(f"vllm-sekv: {e}", file=sys.stderr)
        return 1
    return 0
