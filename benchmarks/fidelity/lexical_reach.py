"""How far lexical block scores (`vllm_sekv.index.lexical`, the scores that
`lexical_weight` fuses into a view's selection) reach: offline, on the
fidelity sessions regenerated (no engine, no GPU), against the selection the
views made on the GPU.

For every question of the sessions of a family and length, the step's prompt
is rendered with the evaluated model's tokenizer; its history is everything
before the last message (the question), the new tokens the rest. Every
history block is scored against the new tokens, and the question's answer
blocks (`run.answer_blocks`, the blocks a view must hold) get their lexical
rank: the worst rank among them. Reported per family: how many questions
have all their answer blocks within the lexical top 16, 64 and `--room`
blocks (an 8K view leaves room for about 240 selected 32-token blocks), next
to how often the views (`views-rerank`) and BM25 retrieval (`rag`) held the
answer in the trials of `--runs`, and how often either the lexical top
`--room` or the views did (what a fusion of the two could reach at most).

    python benchmarks/fidelity/lexical_reach.py --model QWEN_DIR [--families F,...] \\
        [--length 131072] [--sessions 5] [--runs RUN.jsonl ...] [--out benchmarks/results/fidelity]

Writes `lexical_reach.json` (one row per question) and `lexical_reach.md`.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parents[1]))
import report_header as H  # noqa: E402
import sessions as S  # noqa: E402
from corpora import Corpora  # noqa: E402
from report import read_trials  # noqa: E402
from run import answer_blocks  # noqa: E402

from vllm_sekv.index import lexical  # noqa: E402

TOPS = (16, 64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the evaluated model's folder (its tokenizer renders the prompts)")
    ap.add_argument("--families", default="multikey,code,vartrack,squad,hotpotqa")
    ap.add_argument("--length", type=int, default=131072)
    ap.add_argument("--sessions", type=int, default=5)
    ap.add_argument("--block-tokens", type=int, default=32)
    ap.add_argument("--room", type=int, default=240, help="selected blocks a view has room for")
    ap.add_argument("--runs", nargs="+",
                    default=sorted(map(str, (H.results_dir("fidelity") / "runs").glob("*.jsonl"))))
    ap.add_argument("--out", default=str(H.results_dir("fidelity")))
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    trials = read_trials(args.runs)
    bt, corpora, rows = args.block_tokens, Corpora(), []
    for family in args.families.split(","):
        for seed in range(args.sessions):
            session = S.generate(family, args.length, seed, tokenizer, corpora)
            for q in range(len(session.questions)):
                messages = session.step_messages(q)
                ids = S.render_ids(tokenizer, messages)
                start = len(S.render_ids(tokenizer, messages[:-1])) // bt * bt
                wanted = answer_blocks(tokenizer, session, q, bt)
                scores = lexical.block_scores(np.asarray(ids[:start]), ids[start:], bt)
                rank = np.empty(len(scores), dtype=np.int64)
                rank[np.argsort(-scores, kind="stable")] = np.arange(len(scores))
                held = {m: (trials.get((family, args.length, seed, q, f"{m}:8192")) or {}).get("answer_in_view")
                        for m in ("views-rerank", "rag")}
                rows.append({"family": family, "seed": seed, "question": q, "history_blocks": len(scores),
                             "answer_blocks": wanted,
                             "worst_lexical_rank": None if not wanted else int(max(rank[b] for b in wanted)),
                             "views_rerank_in_view": held["views-rerank"], "rag_in_view": held["rag"]})
                print(json.dumps(rows[-1]), flush=True)
    meta = H.meta([H.command(__file__)])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lexical_reach.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    cells = collections.defaultdict(list)
    for r in rows:
        cells[r["family"]].append(r)
    tops = (*TOPS, args.room)
    lines = H.header_from(meta, "Fidelity: how far lexical block scores reach") + [
        f"{args.length}-token sessions, {args.block_tokens}-token blocks; per family, the questions whose answer "
        "blocks all rank within the lexical top k (of every history block), and the trials in which the views "
        "(`views-rerank`, 8K) and BM25 retrieval (`rag`, 8K) held the answer (from the runs' trial lines).", "",
        "| family | n | " + " | ".join(f"lexical top {k}" for k in tops)
        + f" | views-rerank held | lexical top {args.room} or views-rerank | rag held |",
        "|---|---|" + "---|" * (len(tops) + 3)]
    for family, rs in cells.items():
        ranks = [r["worst_lexical_rank"] for r in rs if r["worst_lexical_rank"] is not None]
        held = [sum(bool(r[k]) for r in rs) for k in ("views_rerank_in_view", "rag_in_view")]
        either = sum(bool(r["views_rerank_in_view"]) or (r["worst_lexical_rank"] is not None
                                                         and r["worst_lexical_rank"] < args.room) for r in rs)
        lines.append(f"| {family} | {len(rs)} | " + " | ".join(str(sum(x < k for x in ranks)) for k in tops)
                     + f" | {held[0]} | {either} | {held[1]} |")
    H.write_report(out / "lexical_reach.md", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
