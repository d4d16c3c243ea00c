"""What the views' wrong answers on `multikey` sessions were: offline, from a
run's trial lines and the sessions regenerated (no engine, no GPU).

For every wrong `multikey` trial of the view methods, the number the model
gave is looked up among the session's eight planted facts (three asked, five
not): another question's answer, an unasked fact, or no planted value. For
every trial, whether the asked fact's line is cut by a block boundary of the
served prompt (its key in one `block_tokens` block, its number in a later
one), the case where a 32-token selection can hold the number without the
key that names it.

    python benchmarks/fidelity/misses.py --model QWEN_DIR \\
        [--runs RUN.jsonl [RUN.jsonl ...]] [--out benchmarks/results/fidelity]

`--runs` (default: every file in `benchmarks/results/fidelity/runs/`, in name
order): a trial found in several files counts once, from the last one.

Writes `misses.json` and `misses.md` (headed by machine, commit and command)
into `--out`.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import report_header as H  # noqa: E402
import sessions as S  # noqa: E402
from corpora import Corpora  # noqa: E402
from report import read_trials  # noqa: E402

FACT = re.compile(r"special magic numbers for ([a-z]+-[a-z]+) is: (\d+)\.")
TEXT_METHODS = ("rag", "oracle", "full")


def fact_span_blocks(tokenizer, messages: list[dict], key: str, value: str, block_tokens: int) -> tuple[int, int]:
    """(block of the fact's key, block of its number) in the rendered prompt."""
    ids = S.render_ids(tokenizer, messages)
    text_upto = tokenizer.decode(ids)
    line = f"One of the special magic numbers for {key} is: {value}."
    at = text_upto.index(line)
    key_at, value_at = at + line.index(key), at + line.index(value) + len(value) - 1
    return S.token_at(tokenizer, ids, key_at) // block_tokens, S.token_at(tokenizer, ids, value_at) // block_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the evaluated model's folder (its tokenizer renders the prompts)")
    ap.add_argument("--runs", nargs="+",
                    default=sorted(map(str, (H.results_dir("fidelity") / "runs").glob("*.jsonl"))))
    ap.add_argument("--out", default=str(H.results_dir("fidelity")))
    ap.add_argument("--block-tokens", type=int, default=32)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rows = [r for r in read_trials(args.runs).values() if r["family"] == "multikey"]
    corpora, sessions, cut = Corpora(), {}, {}
    for r in rows:
        sid = (r["history_tokens"], r["seed"])
        if sid not in sessions:
            sessions[sid] = S.generate("multikey", r["history_tokens"], r["seed"], tokenizer, corpora)
        session = sessions[sid]
        q = r["question"]
        if (sid, q) not in cut:
            key = FACT.search(session.questions[q].evidence[0]).group(1)
            kb, vb = fact_span_blocks(tokenizer, session.step_messages(q), key, r["answer"], args.block_tokens)
            cut[sid, q] = kb != vb
    table = collections.defaultdict(collections.Counter)
    for r in rows:
        if not r["method_name"].startswith("views") and r["method_name"] not in TEXT_METHODS:
            continue
        sid = (r["history_tokens"], r["seed"])
        session, q = sessions[sid], r["question"]
        cell = table[(r["history_tokens"], r["method_name"])]
        boundary = "cut" if cut[sid, q] else "whole"
        cell[f"trials_{boundary}"] += 1
        cell[f"correct_{boundary}"] += int(r["correct"])
        if not r["correct"]:
            got = re.sub(r"\D", "", r["response"])
            asked = [x.answers[0] for x in session.questions]
            planted = {v for _, v in FACT.findall("\n".join(m["content"] for m in session.history))}
            kind = ("another question's answer" if got in asked else
                    "an unasked planted fact" if got in planted else "no planted value")
            cell[kind] += 1
    out = {f"{h}/{m}": dict(c) for (h, m), c in sorted(table.items())}
    meta = H.meta([H.command(__file__)])
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "misses.json").write_text(json.dumps({"meta": meta, "cells": out}, indent=1) + "\n")
    kinds = ("another question's answer", "an unasked planted fact", "no planted value")
    lines = H.header_from(meta, "Fidelity: what the wrong answers on multikey sessions were") + [
        f"From {', '.join(f'`{Path(r).name}`' for r in args.runs)}, sessions regenerated with the evaluated model's tokenizer; "
        f"a fact is *cut* when its key and its number fall in different {args.block_tokens}-token blocks "
        "of the served prompt.", "",
        "| history | method | correct, fact whole | correct, fact cut | wrong: " + " | wrong: ".join(kinds) + " |",
        "|---|---|---|---|---|---|---|"]
    for (h, m), c in sorted(table.items()):
        lines.append(f"| {h} | {m} | {c['correct_whole']}/{c['trials_whole']} | {c['correct_cut']}/{c['trials_cut']} | "
                     + " | ".join(str(c[k]) for k in kinds) + " |")
    H.write_report(Path(args.out) / "misses.md", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
