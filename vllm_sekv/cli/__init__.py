"""The `vllm-sekv` command line.

`main(argv)` parses `argv` (default: `sys.argv[1:]`) with one argparse
subcommand per command group, each registered by its module's `add_parser`:

  serve            vLLM's OpenAI-compatible server with the sekv connector  (serve_cmd)
  config           the configuration keys, defaults and environment names   (config_cmd)
  model            prepare a bundled model once                             (model_cmd)
  sessions         inspect and clean an NVMe folder no server uses          (sessions_cmd)
  calibrate        train the SeKV zoom router offline                       (calibrate_cmd)
  calibrate-heads  find the heads the re-rank listens to                    (calibrate_heads_cmd)

Every subcommand has its own `--help`. Returns the command's exit status (0 on
success; each module documents its others). Usage errors (an unknown command,
a missing or unknown argument, a value of the wrong type) and `--help` raise
`SystemExit` as argparse does (status 2 with a message on stderr, and 0).
Only `serve` accepts arguments it does not know: they go to vLLM unchanged.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable

from vllm_sekv.cli import calibrate_cmd, calibrate_heads_cmd, config_cmd, model_cmd, serve_cmd, sessions_cmd

COMMANDS = (serve_cmd, config_cmd, model_cmd, sessions_cmd, calibrate_cmd, calibrate_heads_cmd)


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser whose `arguments(parser)` callback, if given, adds its
    arguments just before its first parse (or `--help`), so that registering
    a command whose defaults need heavy imports (torch) costs nothing until
    that command is used."""

    def __init__(self, *args, arguments: Callable[[argparse.ArgumentParser], None] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._pending_arguments = arguments

    def parse_known_args(self, args=None, namespace=None):
        if self._pending_arguments is not None:
            add, self._pending_arguments = self._pending_arguments, None
            add(self)
        return super().parse_known_args(args, namespace)


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="vllm-sekv",
        description="vllm-sekv: a virtual KV workspace for long-running LLM agents, as a vLLM plugin.",
        epilog="Run `vllm-sekv COMMAND --help` for a command's own arguments.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                       parser_class=CommandParser)
    for module in COMMANDS:
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if extra:
        if not hasattr(args, "passthrough"):
            parser.error("unrecognized arguments: " + " ".join(extra))
        args.passthrough = extra
    return args.run(args)
