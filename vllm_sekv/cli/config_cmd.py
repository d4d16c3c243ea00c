"""`vllm-sekv config`: print each configuration key, its default and the
environment variable that overrides it, one per line. Exit status 0."""
from __future__ import annotations

import argparse
import dataclasses

from vllm_sekv.config import ENV_PREFIX, SekvConfig


def add_parser(subparsers) -> None:
    help_text = "list the configuration keys, their defaults and environment variables"
    parser = subparsers.add_parser("config", help=help_text, description=help_text[0].upper() + help_text[1:] + ".")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    defaults = SekvConfig()
    for f in dataclasses.fields(SekvConfig):
        print(f"{f.name:<20} default {getattr(defaults, f.name)!r:<14} env {ENV_PREFIX}{f.name.upper()}")
    return 0
