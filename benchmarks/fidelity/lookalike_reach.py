"""How many look-alike facts a view holds, as served and as this tree's
`view_lookalikes` drop would select it: offline, from a run's trial lines and
the sessions regenerated (no engine, no GPU).

For every trial of `--method` (a views method with the look-alike drop and
the lexical hop that recorded `probe_ranked`), the view is rebuilt as
`select_reach.py` rebuilds it (`replay.drop_lookalikes_best`, then the latest
history up to the served view's size) with this tree's look-alike rule, at
the method's own selection limit. Per family it counts the views holding
every block of the question's evidence (`answer_blocks`), served and rebuilt,
and, where the family plants facts in one template (`replay.PLANTED`:
`multikey`, `vartrack`), the planted facts other than the question's
evidence whose every block the view holds (look-alike facts), served and
rebuilt (and how many of the rebuilt ones lie in the view's latest history
rather than its selection), and the wrong answers whose served view held
look-alike facts that the rebuilt view holds none of. In every family it
counts the questions where the rule leaves a block of the evidence out of
the ranking (the evidence taken for a look-alike; its passage, a cut line or
the latest history may still bring it back), with the evidence's best place
in the probes' ranking. Answers are not measured: that takes a run.

    python benchmarks/fidelity/lookalike_reach.py --model QWEN_DIR --runs RUN.jsonl [MORE.jsonl ...] \\
        --method views-rerank-rh-lexhop-hop3-sel32-psg8-lines-drop-rcall-ord:8192 --limit 32 \\
        [--out benchmarks/results/fidelity]

Writes `lookalike_reach.json` (one row per trial and the counts) and
`lookalike_reach.md` (headed by machine, commit and command) into `--out`.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import report_header as H  # noqa: E402
import sessions as S  # noqa: E402
from replay import PLANTED, is_evidence, lookalike_ranking, planted_matches  # noqa: E402
from select_reach import add_view_args, method_trials, view_at  # noqa: E402
from vllm_sekv.workspace.vocabulary import Vocabulary  # noqa: E402


def planted_facts(tokenizer, prompt: list[int], family: str, evidence: list[str], block_tokens: int) -> list[range]:
    """The blocks of each planted fact of the history (before the step's last
    user turn) that is not the question's evidence."""
    facts = []
    for m in planted_matches(tokenizer, prompt, family):
        if not is_evidence(m.group(0).rstrip("\n"), evidence):
            last = m.end() - 1 - (m.group(0).endswith("\n"))
            facts.append(range(S.token_at(tokenizer, prompt, m.start()) // block_tokens,
                               S.token_at(tokenizer, prompt, last) // block_tokens + 1))
    return facts


def latest_start(view: set[int]) -> int:
    """The first block of the view's latest history: the run of consecutive
    blocks that ends at its last block."""
    b = max(view)
    while b - 1 in view:
        b -= 1
    return b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_view_args(ap)
    ap.add_argument("--limit", type=int, required=True, help="the method's view_select_blocks")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rows, vocab = [], Vocabulary.of(tokenizer)
    for family, seed, q, r, session, prompt in method_trials(args, tokenizer):
        ranked, kept = lookalike_ranking(prompt, r, vocab, True, args.sink_blocks, args.recent_blocks,
                                         args.block_tokens)
        views = {"served": set(r["selected_blocks"]),
                 "rebuilt": view_at(prompt, r, args.limit, vocab, args.passage_blocks, args.sink_blocks,
                                    args.recent_blocks, args.block_tokens, kept)}
        row = {"family": family, "seed": seed, "question": q, "correct": r["correct"]}
        for name, view in views.items():
            row[f"{name}_in_view"] = all(b in view for b in r["answer_blocks"] or [])
        evidence = [b for b in r["answer_blocks"] or [] if b in ranked]
        row["evidence_place"] = min((ranked.index(b) for b in evidence), default=None)
        row["evidence_left_out"] = sorted(set(evidence) - set(kept))
        if family in PLANTED:
            facts = planted_facts(tokenizer, prompt, family, session.questions[q].evidence, args.block_tokens)
            for name, view in views.items():
                row[f"{name}_lookalikes"] = sum(all(b in view for b in fact) for fact in facts)
            latest = latest_start(views["rebuilt"])
            row["rebuilt_lookalikes_latest"] = sum(all(b in views["rebuilt"] for b in fact) and fact[0] >= latest
                                                   for fact in facts)
        rows.append(row)
        print(f"[lookalike_reach] {family}-{seed} q{q} {row}", flush=True)
    summary = {}
    for family in sorted({r["family"] for r in rows}):
        fam = [r for r in rows if r["family"] == family]
        counts = {"n": len(fam), "correct": sum(r["correct"] for r in fam),
                  **{f"{v}_in_view": sum(r[f"{v}_in_view"] for r in fam) for v in ("served", "rebuilt")}}
        left_out = [r for r in fam if r["evidence_left_out"]]
        counts["evidence_left_out"] = len(left_out)
        counts["evidence_left_out_wrong"] = sum(not r["correct"] for r in left_out)
        counts["evidence_left_out_not_in_view"] = sum(not r["rebuilt_in_view"] for r in left_out)
        if family in PLANTED:
            for v in ("served", "rebuilt"):
                counts[f"{v}_lookalikes"] = sum(r[f"{v}_lookalikes"] for r in fam)
                counts[f"{v}_views_with_lookalikes"] = sum(r[f"{v}_lookalikes"] > 0 for r in fam)
            counts["rebuilt_lookalikes_latest"] = sum(r["rebuilt_lookalikes_latest"] for r in fam)
            wrong = [r for r in fam if not r["correct"] and r["served_lookalikes"] > 0]
            counts["wrong_with_lookalikes"] = len(wrong)
            counts["wrong_cleared"] = sum(not r["rebuilt_lookalikes"] for r in wrong)
        summary[family] = counts
    meta = H.meta(H.command(__file__))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lookalike_reach.json").write_text(json.dumps({"meta": meta, "summary": summary, "trials": rows},
                                                         indent=1))
    lines = H.header_from(meta, f"Fidelity: look-alike facts in the view (`{args.method}`)") + [
        f"{len(rows)} questions at {args.length} tokens. Served: the views the run's server selected; rebuilt: "
        f"the same rankings through this tree's `view_lookalikes` drop, at `view_select_blocks` {args.limit}. "
        "Evidence: views holding every block of the question's evidence. Look-alike facts: planted facts other "
        "than the evidence whose every block the view holds (summed over the views; in brackets, the views "
        "holding any); of the rebuilt views' ones, those in the latest history (the run of blocks that ends the "
        "view), the rest coming with the selection. Wrong answers cleared: of the served views that answered wrong "
        "and held look-alike facts, those whose rebuilt view holds none. Evidence left out: questions where the "
        "rule takes a block of the evidence for a look-alike and leaves it out of the ranking (in brackets: of "
        "them, answered wrong as served / not in the rebuilt view).", "",
        "| family | n | answered | evidence served | evidence rebuilt | look-alike facts served | "
        "look-alike facts rebuilt | of them in the latest history | wrong answers cleared | evidence left out |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for family, c in summary.items():
        if family in PLANTED:
            facts = (f"{c['served_lookalikes']} ({c['served_views_with_lookalikes']}) | "
                     f"{c['rebuilt_lookalikes']} ({c['rebuilt_views_with_lookalikes']}) | "
                     f"{c['rebuilt_lookalikes_latest']} | {c['wrong_cleared']} of {c['wrong_with_lookalikes']}")
        else:
            facts = "- | - | - | -"
        lines.append(f"| {family} | {c['n']} | {c['correct']} | {c['served_in_view']} | {c['rebuilt_in_view']} | "
                     f"{facts} | {c['evidence_left_out']} ({c['evidence_left_out_wrong']} / "
                     f"{c['evidence_left_out_not_in_view']}) |")
    left_out = [r for r in rows if r["evidence_left_out"]]
    if left_out:
        lines += ["", "Questions whose evidence the rule leaves out of the ranking:", "",
                  "| family | seed | question | answered | evidence's best place | blocks left out "
                  "| in the rebuilt view |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['family']} | {r['seed']} | {r['question']} | {'yes' if r['correct'] else 'no'} | "
                  f"{r['evidence_place']} | {', '.join(map(str, r['evidence_left_out']))} | "
                  f"{'yes' if r['rebuilt_in_view'] else 'no'} |" for r in left_out]
    H.write_report(out / "lookalike_reach.md", lines)
    print("\n".join(lines[12:]), flush=True)


if __name__ == "__main__":
    main()
