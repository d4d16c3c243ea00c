"""Where a view's ranking puts the look-alikes of the asked fact: offline,
from a run's trial lines and the sessions regenerated (no engine, no GPU).

For every `vartrack` trial of a views method that recorded its rankings
(`ranked_blocks`, the selection's order; `probe_ranked`, each probe's best
candidates): the blocks of the asked chain's lines (the question's
evidence) and of the session's other planted lines (look-alikes: the same
`VAR ABCDE = ...` template, other names), found in the history before the
step's question; the rank of each in the selection's and in each probe's
ranking; how many look-alike blocks the served view held; whether the lead
block (`index.lookalikes.lead_block`: of the first probe's best 4, the one
the question's own rare tokens name) is a line of the asked chain; how many
of the chain's blocks `view_lookalikes` drop leaves out as look-alikes, from
the lead block alone and from the lead lines (the block with the rest of the
lines its boundaries cut), every block a candidate in the served ranking's
order; and where a lexical hop from the lead lines ranks the chain's other
blocks: BM25 over token ids, each history block scored alone
(`index.lexical.hop_scores`, as `probe_lexical_hop` scores them; the served
hop ranks the probe's candidates only, so a block ranks there at least as
high as here).

    python benchmarks/fidelity/lookalikes.py --model QWEN_DIR --runs RUN.jsonl \\
        --method views-rerank-rh-hop3-sel16-psg8-rcall-ord:8192 [--out benchmarks/results/fidelity]

Writes `lookalikes.json` (one row per trial and a summary) and
`lookalikes.md` (headed by machine, commit and command) into `--out`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import report_header as H  # noqa: E402
import sessions as S  # noqa: E402
from corpora import Corpora  # noqa: E402
from replay import is_evidence, lead_lines, lexical_hop, planted_matches, without_lookalikes_of  # noqa: E402
from vllm_sekv.index.lookalikes import lead_block  # noqa: E402
from vllm_sekv.workspace.passages import break_token_ids  # noqa: E402
from report import read_trials  # noqa: E402


def ranks(ranking: list[int], blocks: set[int]) -> list[int]:
    """1-based ranks of those of `blocks` that `ranking` (best first) holds."""
    return sorted(ranking.index(b) + 1 for b in blocks if b in ranking)


def planted_blocks(tokenizer, prompt: list[int], evidence: list[str], block_tokens: int) -> tuple[set, set]:
    """(blocks of the asked chain's lines, blocks of the other planted lines
    and of no chain line) in the history before the step's last user turn."""
    chain, other = set(), set()
    for m in planted_matches(tokenizer, prompt, "vartrack"):
        fact = m.group(0).rstrip("\n")
        first = S.token_at(tokenizer, prompt, m.start()) // block_tokens
        last = S.token_at(tokenizer, prompt, m.end() - 1) // block_tokens
        (chain if is_evidence(fact, evidence) else other).update(range(first, last + 1))
    return chain, other - chain


def chain_dropped(prompt: list[int], end: int, order: list[int], lead: tuple[int, int], chain: set[int], lo: int,
                  hi: int, block_tokens: int) -> list[int]:
    """The blocks of `chain` that `view_lookalikes` drop leaves out as
    look-alikes of the lead lines `lead`: every block of `[lo, hi)` a
    candidate, ranked as `order`; the history is `prompt[:end]`, the rest the
    step's new tokens."""
    kept = set(without_lookalikes_of(prompt[:end], prompt[end:], order, lead, lo, hi, block_tokens))
    return [b for b in sorted(chain) if lo <= b < hi and b not in kept]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the evaluated model's folder (its tokenizer)")
    ap.add_argument("--runs", nargs="+", required=True)
    ap.add_argument("--method", required=True, help="a views method whose trials recorded probe_ranked")
    ap.add_argument("--length", type=int, default=131072)
    ap.add_argument("--sink-blocks", type=int, default=2)
    ap.add_argument("--recent-blocks", type=int, default=8)
    ap.add_argument("--block-tokens", type=int, default=32)
    ap.add_argument("--out", default=str(H.results_dir("fidelity")))
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    corpora, sessions, rows, breaks = Corpora(), {}, [], break_token_ids(tokenizer)
    bt = args.block_tokens
    for (family, length, seed, q, method), r in sorted(read_trials(args.runs).items()):
        if family != "vartrack" or length != args.length or method != args.method or not r.get("probe_ranked"):
            continue
        if seed not in sessions:
            sessions[seed] = S.generate(family, length, seed, tokenizer, corpora)
        prompt = S.render_ids(tokenizer, sessions[seed].step_messages(q))
        chain, other = planted_blocks(tokenizer, prompt, sessions[seed].questions[q].evidence, bt)
        lo, hi = args.sink_blocks, max(r["selected_blocks"]) + 1 - args.recent_blocks
        other = {b for b in other if lo <= b < hi}
        best = [b for b in r["probe_ranked"][0] if lo <= b < hi]
        first, end = best[0], (max(r["selected_blocks"]) + 1) * bt
        lead = lead_block(prompt[:end], best, prompt[end:], bt)
        history, lines = prompt[: hi * bt], lead_lines(prompt[:end], lead, breaks, bt)
        own = set(range(lines[0] // bt, (lines[1] + bt - 1) // bt))  # the lead lines' blocks
        hop = lexical_hop(history, lines, lo, hi, hi - lo, bt)
        served = [b for b in r["ranked_blocks"] if lo <= b < hi]
        order = served + sorted(set(range(lo, hi)) - set(served))
        dropped = [chain_dropped(prompt, end, order, span, chain, lo, hi, bt) for span in ((lead * bt, lead * bt + bt),
                                                                                           lines)]
        rows.append({"seed": seed, "question": q, "correct": r["correct"], "chain_blocks": sorted(chain),
                     "lookalike_blocks": len(other), "lookalikes_in_view": len(other & set(r["selected_blocks"])),
                     "chain_ranks": ranks(r["ranked_blocks"], chain),
                     "lookalike_ranks": ranks(r["ranked_blocks"], other),
                     "probe_chain_ranks": [ranks(p, chain) for p in r["probe_ranked"]],
                     "probe_lookalike_ranks": [ranks(p, other)[:8] for p in r["probe_ranked"]],
                     "first_probe_best_in_chain": first in chain, "lead_block_in_chain": lead in chain,
                     "chain_dropped_block_alone": dropped[0], "chain_dropped_lead_lines": dropped[1],
                     "lexical_hop_chain_ranks": ranks(hop, chain - own)})
    outranked = [r for r in rows if r["chain_ranks"] and r["lookalike_ranks"]
                 and min(r["lookalike_ranks"]) < max(r["chain_ranks"])]
    hop_first = [r for r in rows if r["lead_block_in_chain"] and r["lexical_hop_chain_ranks"]
                 and r["lexical_hop_chain_ranks"][0] == 1]
    summary = {"n": len(rows),
               "lookalikes_in_view_median": statistics.median(r["lookalikes_in_view"] for r in rows),
               "lookalike_outranks_a_chain_block": len(outranked),
               "best_lookalike_rank_median": statistics.median(min(r["lookalike_ranks"]) for r in rows
                                                               if r["lookalike_ranks"]),
               "first_probe_best_in_chain": sum(r["first_probe_best_in_chain"] for r in rows),
               "lead_block_in_chain": sum(r["lead_block_in_chain"] for r in rows),
               "lexical_hop_ranks_another_chain_block_first": len(hop_first),
               "chain_dropped_block_alone": sum(bool(r["chain_dropped_block_alone"]) for r in rows),
               "chain_dropped_lead_lines": sum(bool(r["chain_dropped_lead_lines"]) for r in rows)}
    meta = H.meta(H.command(__file__))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lookalikes.json").write_text(json.dumps({"meta": meta, "summary": summary, "trials": rows}, indent=1))
    lines = H.header_from(meta, f"Fidelity: where the ranking puts the look-alikes (`vartrack`, `{args.method}`)") + [
        f"{summary['n']} questions. The served views held {summary['lookalikes_in_view_median']} look-alike "
        f"blocks at the median; a look-alike outranked a block of the asked chain in the selection's ranking in "
        f"{summary['lookalike_outranks_a_chain_block']} (the best look-alike at rank "
        f"{summary['best_lookalike_rank_median']} at the median). The first probe's best block was a line of the "
        f"asked chain in {summary['first_probe_best_in_chain']}, the lead block (`index.lookalikes.lead_block`) in "
        f"{summary['lead_block_in_chain']}; in {summary['lexical_hop_ranks_another_chain_block_first']} "
        "of those the lexical hop from its lines ranked another block of the chain first. Leaving out look-alikes "
        f"drops a block of the asked chain in {summary['chain_dropped_block_alone']} from the lead block alone, in "
        f"{summary['chain_dropped_lead_lines']} from the lead lines.", "",
        "| seed | question | correct | chain blocks | look-alikes in view | chain ranks | look-alike ranks | "
        "first probe: chain / look-alikes | second probe: chain / look-alikes | lexical hop: chain | "
        "chain dropped: block alone / lead lines |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pc, pl = r["probe_chain_ranks"], r["probe_lookalike_ranks"]
        lines.append(f"| {r['seed']} | {r['question']} | {'yes' if r['correct'] else 'no'} | {r['chain_blocks']} | "
                     f"{r['lookalikes_in_view']} of {r['lookalike_blocks']} | {r['chain_ranks']} | "
                     f"{r['lookalike_ranks']} | {pc[0]} / {pl[0][:4]} | {pc[1] if len(pc) > 1 else '-'} / "
                     f"{pl[1][:4] if len(pl) > 1 else '-'} | {r['lexical_hop_chain_ranks'][:3]} | "
                     f"{r['chain_dropped_block_alone']} / {r['chain_dropped_lead_lines']} |")
    H.write_report(out / "lookalikes.md", lines)
    print("\n".join(lines[:12]), flush=True)


if __name__ == "__main__":
    main()
