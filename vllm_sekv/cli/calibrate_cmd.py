"""`vllm-sekv calibrate MODEL --out PATH [options]`.

Calls `vllm_sekv.calibrate.run` with a `CalibrateArgs` made of the options
(whose defaults are `CalibrateArgs`'s) and prints its report. Exit status 2,
with the reason on stderr, on a bad value (`ValueError` naming the argument)
or a bundled model whose packages are missing.
"""
from __future__ import annotations

import argparse
import sys

DESCRIPTION = """\
Train the SeKV zoom router offline (frozen model, CPU, essay text) and write
the small file that the `router_path` key loads. Captured samples are cached
(--cache-dir), so re-runs skip the model. Method: vllm_sekv/calibrate.py."""


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("calibrate", help="train the SeKV zoom router offline", description=DESCRIPTION,
                                   formatter_class=argparse.RawDescriptionHelpFormatter, arguments=_arguments)
    parser.set_defaults(run=run)


def _arguments(parser: argparse.ArgumentParser) -> None:
    from vllm_sekv.calibrate import CalibrateArgs  # imports torch: only once this command is used

    d = CalibrateArgs(model="", out="")
    add = parser.add_argument
    add("model", metavar="MODEL",
        help="a bundled model (`smollm2`, `qwen2.5-coder-1.5b`) or a Hugging Face folder")
    add("--out", required=True, metavar="PATH", help="router file to write (load it with the router_path key)")
    for flag, kind, default, text in (
        ("--texts", int, d.texts, "training texts"),
        ("--heldout", int, d.heldout, "held-out texts (unseen essays)"),
        ("--tokens", int, d.tokens, "tokens per text (history + new)"),
        ("--new-tokens", int, d.new_tokens, "last tokens of a text: the step's queries"),
        ("--steps", int, d.steps, "training steps (one text each)"),
        ("--alpha", float, d.alpha, "surprisal segmentation threshold"),
        ("--seed", int, d.seed, "seed of the texts, the router's initial weights and the training order"),
        ("--lr", float, d.lr, "Adam learning rate"),
        ("--sink-tokens", int, d.sink_tokens, "history kept from the start"),
        ("--recent-tokens", int, d.recent_tokens, "history kept from the end"),
        ("--threads", int, d.threads, "torch CPU threads"),
    ):
        add(flag, type=kind, default=default, metavar="N" if kind is int else "X",
            help=text + " (default: %(default)s)")
    add("--distance", action="store_true", help="add a learned per-head recency term (default: position-free router)")
    add("--budgets", type=int, nargs="+", default=list(d.budgets), metavar="TOKENS",
        help="token budgets of the coverage report (default: %(default)s)")
    add("--cache-dir", default=d.cache_dir, metavar="DIR",
        help="captured samples; re-runs skip the model (default: %(default)s)")


def run(a: argparse.Namespace) -> int:
    from vllm_sekv.calibrate import CalibrateArgs, format_report, run as calibrate
    from vllm_sekv.models import ModelPackageMissing

    args = CalibrateArgs(model=a.model, out=a.out, texts=a.texts, heldout=a.heldout, tokens=a.tokens,
                         new_tokens=a.new_tokens, steps=a.steps, alpha=a.alpha, seed=a.seed, lr=a.lr,
                         sink_tokens=a.sink_tokens, recent_tokens=a.recent_tokens, use_distance=a.distance,
                         budgets=tuple(a.budgets), cache_dir=a.cache_dir, threads=a.threads)
    try:
        res = calibrate(args)
    except (ValueError, ModelPackageMissing) as e:
        print(f"vllm-sekv: {e}", file=sys.stderr)
        return 2
    print(format_report(res))
    print(f"\nwrote {a.out}: {res['num_parameters']} parameters, {res['file_bytes']} bytes; capture "
          f"{res['capture_s']:.0f} s, training {res['train_s']:.0f} s")
    return 0
