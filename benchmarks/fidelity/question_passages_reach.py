"""What text retrieval's passages bring a view: offline, from the runs' trial
lines and the sessions regenerated (no engine, no GPU).

* **Reach**: for every question of `--families` at `--length` (seeds from
  `--seeds`), the rank of the worst-ranked evidence line among the tool
  results' passages as `rag` ranks them against the question (`bm25s`,
  `prompts.rag`); per family, the questions whose whole evidence lies in
  BM25's best k passages, the served views of `--base` that held it
  (`answer_in_view`), and one or the other.
* **Lost answers**: for every question `--base` answered and `--method` (a
  views method with `view_question_passages`, whose trial lines record
  `question_blocks`) did not, whether the wrong answer's text stands in the
  question's passages only, elsewhere in the view, or nowhere in it (the
  served view's blocks decoded).

    python benchmarks/fidelity/question_passages_reach.py --model QWEN_DIR --length 262144 --seeds 0-7 \\
        --method views-accurate-qp8:8192 [--out benchmarks/results/fidelity/question_passages]

Writes `question_passages_reach.json` (one row per question) and
`question_passages_reach.md` (headed by machine, commit and command) into `--out`.
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
import prompts as P  # noqa: E402
import report_header as H  # noqa: E402
import sessions as S  # noqa: E402
from corpora import Corpora  # noqa: E402
from report import read_trials  # noqa: E402

TOPS = (2, 4, 8, 16)
BASE = "views-rerank-rh-lexhop-hop3-sel32-psg8-lines-drop-rcall-ord:8192"  # the accurate preset's served views


def worst_rank(session: S.Session, q: int, tokenizer) -> int | None:
    """The rank (0-based) among `rag`'s passages of the worst-ranked line of
    question `q`'s evidence (each line's best passage); None where a line is
    in no passage."""
    import bm25s

    _, pairs, _ = P._split(session, q)
    passages = P._passages(tokenizer, pairs)
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize([p[2] for p in passages], stopwords="en", show_progress=False),
                    show_progress=False)
    order, _ = retriever.retrieve(bm25s.tokenize([session.questions[q].text], stopwords="en", show_progress=False),
                                  k=len(passages), show_progress=False)
    ranked = [passages[int(i)][2] for i in order[0]]
    ranks = [next((k for k, text in enumerate(ranked) if line in text), None)
             for evidence in session.questions[q].evidence for line in evidence.split("\n") if line.strip()]
    return None if None in ranks else max(ranks)


def wrong_answer_source(ids: list[int], trial: dict, tokenizer, block_tokens: int) -> str:
    """Where the wrong answer of `trial` stands in its served view:
    `question passages` (only there), `view` (elsewhere in it) or `nowhere`."""
    def text(blocks) -> str:
        return tokenizer.decode([t for b in sorted(blocks) for t in ids[b * block_tokens:(b + 1) * block_tokens]])

    answer = trial["response"].strip().strip(".'\"`")
    added = set(trial.get("question_blocks") or ())
    if answer and answer in text(set(trial["selected_blocks"]) - added):
        return "view"
    return "question passages" if answer and answer in text(added) else "nowhere"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the evaluated model's folder (its tokenizer renders the prompts)")
    ap.add_argument("--families", default="hotpotqa,squad,code", help="the families whose reach is counted")
    ap.add_argument("--length", type=int, default=262144)
    ap.add_argument("--seeds", default="0-7", help="FIRST-LAST")
    ap.add_argument("--method", required=True, help="the views method with question passages")
    ap.add_argument("--base", default=BASE, help="the views method it is paired with")
    ap.add_argument("--block-tokens", type=int, default=32)
    ap.add_argument("--runs", nargs="+",
                    default=sorted(map(str, (H.results_dir("fidelity") / "runs").glob("*.jsonl"))))
    ap.add_argument("--out", default=str(H.results_dir("fidelity") / "question_passages"))
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    trials = read_trials(args.runs)
    first, last = map(int, args.seeds.split("-"))
    families = args.families.split(",")
    lost = {(f, s, q) for (f, n, s, q, m), t in trials.items()
            if n == args.length and first <= s <= last and m == args.method and not t["correct"]
            and (trials.get((f, n, s, q, args.base)) or {}).get("correct")}
    corpora, rows = Corpora(), []
    for family in dict.fromkeys([*families, *sorted({f for f, _, _ in lost})]):
        for seed in range(first, last + 1):
            if family not in families and not any(f == family and s == seed for f, s, _ in lost):
                continue
            session = S.generate(family, args.length, seed, tokenizer, corpora)
            for q in range(len(session.questions)):
                base = trials.get((family, args.length, seed, q, args.base)) or {}
                served = trials.get((family, args.length, seed, q, args.method)) or {}
                row = {"family": family, "seed": seed, "question": q, "base_in_view": base.get("answer_in_view"),
                       "in_view": served.get("answer_in_view"), "base_correct": base.get("correct"),
                       "correct": served.get("correct")}
                if family in families:
                    row["bm25_worst_rank"] = worst_rank(session, q, tokenizer)
                if (family, seed, q) in lost:
                    ids = S.render_ids(tokenizer, session.step_messages(q))
                    row["wrong_answer"] = served["response"]
                    row["wrong_answer_in"] = wrong_answer_source(ids, served, tokenizer, args.block_tokens)
                rows.append(row)
                print(json.dumps(row), flush=True)
    meta = H.meta([H.command(__file__)])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "question_passages_reach.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = H.header_from(meta, "Fidelity: what text retrieval's passages bring a view") + [
        f"{args.length}-token sessions, seeds {args.seeds}. Reach: per family, the questions whose whole evidence "
        "lies in BM25's best k passages (as `rag` ranks the tool results' passages against the question), the "
        f"served views of `{args.base}` that held it, and either.", "",
        "| family | n | " + " | ".join(f"BM25 top {k}" for k in TOPS) + " | served view held | "
        + " | ".join(f"view or top {k}" for k in TOPS) + " |",
        "|---|---|" + "---|" * (2 * len(TOPS) + 1)]
    for family in families:
        rs = [r for r in rows if r["family"] == family]
        worst = [r["bm25_worst_rank"] for r in rs]
        lines.append(f"| {family} | {len(rs)} | " + " | ".join(str(sum(w is not None and w < k for w in worst))
                                                             for k in TOPS)
                     + f" | {sum(bool(r['base_in_view']) for r in rs)} | "
                     + " | ".join(str(sum(bool(r["base_in_view"]) or (r["bm25_worst_rank"] is not None
                                                                    and r["bm25_worst_rank"] < k) for r in rs))
                                  for k in TOPS) + " |")
    wrong = [r for r in rows if "wrong_answer_in" in r]
    where = collections.Counter(r["wrong_answer_in"] for r in wrong)
    lines += ["", f"Lost answers: the {len(wrong)} questions `{args.base}` answered and `{args.method}` did not; "
              "where the wrong answer's text stands in the served view.", "",
              "| family | seed | question | wrong answer | stands in |", "|---|---|---|---|---|"]
    lines += [f"| {r['family']} | {r['seed']} | {r['question']} | `{r['wrong_answer'].strip()[:40]}` | "
              f"{r['wrong_answer_in']} |" for r in wrong]
    lines += ["", "In all: " + ", ".join(f"{k} {v}" for k, v in where.most_common()) + "."]
    H.write_report(out / "question_passages_reach.md", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
