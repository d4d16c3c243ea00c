"""How many views would hold their evidence with a larger selection: offline,
from a run's trial lines and the sessions regenerated (no engine, no GPU).

A view with `view_select_blocks` N and `view_passage_blocks` P stops its
selection after N blocks, and a selected block's passage counts against N:
with passages of up to 8 blocks, `view_select_blocks` 16 holds two or three
paragraphs, and a paragraph the probes rank third is left to the latest
history. For every trial of `--method` (a views method with the look-alike
drop and the lexical hop that recorded `probe_ranked`) this script rebuilds
the selection the server made, as `replay.py`'s `drop-lookalikes` variant
does (the probes' rankings with the lexical hop from the lead lines taken in
turn, the lead lines' look-alikes left out, each block with its passage and
its cut lines, then the latest history up to the served view's size), for
each limit of `--limits`, and counts per family the views holding every
block of the question's evidence (`answer_blocks`). The first limit should
be the method's own: its count is checked against the served views'
`answer_in_view` question by question (`agrees`).

    python benchmarks/fidelity/select_reach.py --model QWEN_DIR --runs RUN.jsonl \\
        --method views-rerank-rh-lexhop-hop3-sel16-psg8-lines-drop-rcall-ord:8192 \\
        [--limits 16 24 32 48 64] [--out benchmarks/results/fidelity]

Writes `select_reach.json` (one row per trial and the counts) and
`select_reach.md` (headed by machine, commit and command) into `--out`.
Answers are not measured: what a larger selection answers takes a run.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import report_header as H  # noqa: E402
import sessions as S  # noqa: E402
from corpora import Corpora  # noqa: E402
from replay import drop_lookalikes_best, recency_filled  # noqa: E402
from report import read_trials  # noqa: E402
from vllm_sekv.workspace.vocabulary import Vocabulary  # noqa: E402


def view_at(prompt: list[int], trial: dict, limit: int, vocab, passage_blocks: int, sink_blocks: int,
            recent_blocks: int, bt: int, kept: list[int] | None = None) -> set[int]:
    """The blocks of the view the trial's server would have served with
    `view_select_blocks` `limit`: sink, selection, latest history up to the
    served view's size (`replay.py`'s `drop-lookalikes` composition; `kept`:
    its ranking without look-alikes, where the caller has it)."""
    best = drop_lookalikes_best(prompt, trial, limit, vocab, True, passage_blocks, True, sink_blocks, recent_blocks,
                                bt, kept)
    return set(recency_filled(trial["selected_blocks"], best))


def add_view_args(ap: argparse.ArgumentParser) -> None:
    """The arguments of a script that rebuilds a run's served views."""
    ap.add_argument("--model", required=True, help="the evaluated model's folder (its tokenizer)")
    ap.add_argument("--runs", nargs="+", required=True)
    ap.add_argument("--method", required=True, help="a views method with -lexhop- and -drop- that recorded "
                                                    "probe_ranked")
    ap.add_argument("--passage-blocks", type=int, default=8, help="the method's view_passage_blocks")
    ap.add_argument("--length", type=int, default=131072)
    ap.add_argument("--sink-blocks", type=int, default=2)
    ap.add_argument("--recent-blocks", type=int, default=8)
    ap.add_argument("--block-tokens", type=int, default=32)
    ap.add_argument("--out", default=str(H.results_dir("fidelity")))


def method_trials(args, tokenizer):
    """(family, seed, question, trial line, session, step prompt ids) of each
    trial of `args.method` at `args.length` that recorded `probe_ranked`, in
    order; each session generated once."""
    corpora, sessions = Corpora(), {}
    for (family, length, seed, q, method), r in sorted(read_trials(args.runs).items()):
        if length != args.length or method != args.method or not r.get("probe_ranked"):
            continue
        if (family, seed) not in sessions:
            sessions[family, seed] = S.generate(family, length, seed, tokenizer, corpora)
        session = sessions[family, seed]
        yield family, seed, q, r, session, S.render_ids(tokenizer, session.step_messages(q))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_view_args(ap)
    ap.add_argument("--limits", type=int, nargs="+", default=[16, 24, 32, 48, 64],
                    help="view_select_blocks to rebuild; the first: the method's own")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rows, vocab = [], Vocabulary.of(tokenizer)
    for family, seed, q, r, _, prompt in method_trials(args, tokenizer):
        held = [all(b in view_at(prompt, r, limit, vocab, args.passage_blocks, args.sink_blocks,
                                 args.recent_blocks, args.block_tokens) for b in r["answer_blocks"])
                for limit in args.limits]
        rows.append({"family": family, "seed": seed, "question": q, "correct": r["correct"],
                     "served_in_view": r["answer_in_view"], "in_view": dict(zip(map(str, args.limits), held))})
        print(f"[select_reach] {family}-{seed} q{q} {held}", flush=True)
    families = sorted({r["family"] for r in rows})
    counts = {f: {str(k): sum(r["in_view"][str(k)] for r in rows if r["family"] == f) for k in args.limits}
              for f in families}
    first = str(args.limits[0])
    agrees = sum(r["in_view"][first] == r["served_in_view"] for r in rows)
    wrong_gained = collections.Counter(k for r in rows if not r["correct"] and not r["in_view"][first]
                                       for k, v in r["in_view"].items() if v)
    summary = {"n": len(rows), "counts": counts, "served_in_view": sum(r["served_in_view"] for r in rows),
               "agrees": agrees, "wrong_answers_gaining_evidence": dict(wrong_gained)}
    meta = H.meta(H.command(__file__))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "select_reach.json").write_text(json.dumps({"meta": meta, "summary": summary, "trials": rows}, indent=1))
    lines = H.header_from(meta, f"Fidelity: the evidence in the view by selection limit (`{args.method}`)") + [
        f"{len(rows)} questions at {args.length} tokens, {args.passage_blocks}-block passages. Views holding every "
        f"block of the question's evidence, per family, rebuilt with each `view_select_blocks`; the rebuilt views "
        f"at {first} agree with the served views' `answer_in_view` on {agrees} of {len(rows)} (served: "
        f"{summary['served_in_view']}).", "",
        "| family | n | " + " | ".join(f"select {k}" for k in args.limits) + " |",
        "|---|---|" + "---|" * len(args.limits)]
    for f in families:
        n = sum(r["family"] == f for r in rows)
        lines.append(f"| {f} | {n} | " + " | ".join(str(counts[f][str(k)]) for k in args.limits) + " |")
    lines.append("| all | " + f"{len(rows)} | " + " | ".join(str(sum(c[str(k)] for c in counts.values()))
                                                         for k in args.limits) + " |")
    lines += ["", "Questions the served view answered wrong without its evidence that a larger selection would "
              "hold it for: " + ", ".join(f"{wrong_gained.get(str(k), 0)} at {k}" for k in args.limits[1:]) + "."]
    H.write_report(out / "select_reach.md", lines)
    print("\n".join(lines[12:]), flush=True)


if __name__ == "__main__":
    main()
