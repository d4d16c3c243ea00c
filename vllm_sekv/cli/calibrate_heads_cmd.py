"""`vllm-sekv calibrate-heads MODEL --out PATH [options]`.

Calls `vllm_sekv.calibrate_heads.run` with a `HeadsArgs` made of the options
(whose defaults are `HeadsArgs`'s) and prints the heads it found. Exit status
2, with the reason on stderr, on a bad value (`ValueError` naming the
argument) or a bundled model whose packages are missing.
"""
from __future__ import annotations

import argparse
import sys

DESCRIPTION = """\
Find the model's retrieval heads offline (frozen model, CPU, essay text with
planted look-alike facts) and write the small file that the
rerank_heads_path key loads: the token-level re-rank then combines those
heads only. Method: vllm_sekv/calibrate_heads.py."""


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("calibrate-heads", help="find the heads the re-rank listens to",
                                   description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
                                   arguments=_arguments)
    parser.set_defaults(run=run)


def _arguments(parser: argparse.ArgumentParser) -> None:
    from vllm_sekv.calibrate_heads import HeadsArgs

    d = HeadsArgs(model="", out="")
    add = parser.add_argument
    add("model", metavar="MODEL",
        help="a bundled model (`smollm2`, `qwen2.5-coder-1.5b`) or a Hugging Face folder")
    add("--out", required=True, metavar="PATH", help="heads file to write (load it with the rerank_heads_path key)")
    for flag, default, text in (
        ("--texts", d.texts, "texts measured"),
        ("--tokens", d.tokens, "history tokens per text"),
        ("--facts", d.facts, "look-alike facts planted per text (one is asked)"),
        ("--heads", d.heads, "heads written, best first"),
        ("--sink-tokens", d.sink_tokens, "history left out of the shares (a view's sink)"),
        ("--seed", d.seed, "seed of the texts and facts"),
        ("--threads", d.threads, "torch CPU threads"),
    ):
        add(flag, type=int, default=default, metavar="N", help=text + " (default: %(default)s)")


def run(a: argparse.Namespace) -> int:
    from vllm_sekv.calibrate_heads import HeadsArgs, format_report, run as calibrate
    from vllm_sekv.models import ModelPackageMissing

    args = HeadsArgs(model=a.model, out=a.out, texts=a.texts, tokens=a.tokens, facts=a.facts, heads=a.heads,
                     sink_tokens=a.sink_tokens, seed=a.seed, threads=a.threads)
    try:
        res = calibrate(args)
    except (ValueError, ModelPackageMissing) as e:
        print(f"vllm-sekv: {e}", file=sys.stderr)
        return 2
    print(format_report(res))
    print(f"\nwrote {a.out} ({res['seconds']:.0f} s)")
    return 0
