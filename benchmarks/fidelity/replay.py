"""Replay recorded views on this machine's CPU, as they were or changed.

A view whose selected blocks are all recomputed in virtual order (the
`-rcall-ord` methods) is a plain prefill of its tokens at positions
0..V-1: its sink is the prompt's first blocks, computed the same way in any
context. So what such a view answers depends only on which blocks it held,
and a run's trial lines (`selected_blocks`, every block of the view in
virtual order) with the sessions regenerated give back its exact tokens: the
selected blocks, then the prompt after the last of them. This script
rebuilds them, changes them as a variant says, and answers each with vLLM on
the CPU (greedy, as the servers did), so questions about what a view should
hold are answered without a GPU:

* `as-run`          the view as it was served: checks the replay (its answers
                    against the served view's, question by question).
* `no-lookalikes`   the same view without the planted facts the question does
                    not ask about (`multikey`: the other keys' lines;
                    `vartrack`: the other chains' lines), their tokens
                    deleted: what the view would answer had its selection
                    told the asked fact from its look-alikes.
* `separated`       a line `...` between blocks that are not adjacent in the
                    history, so fragments do not run into each other.
* `recency-fill`    the best-scoring blocks only, then the latest history
                    blocks up to this view's size, as the oracle prompt fills
                    its room with the latest turns. The best blocks: the
                    sink and the first `--fill-top` of the trial's
                    `ranked_blocks` (the selection's order, where the run
                    recorded it), or those of a smaller view of the same
                    question (`--fill-from`, a method of the same runs, e.g.
                    `views-rerank-rcall-ord:4096`). With `--fill-context C`
                    each ranked block brings C neighbours on each side, the
                    neighbours counting against `--fill-top`, as a view
                    with `view_select_blocks` and `view_context_blocks`
                    selects (a line cut by a block boundary comes whole);
                    with `--fill-passages P` instead, its paragraph or turn
                    where that spans at most P blocks (`view_passage_blocks`);
                    with `--fill-lines`, also the rest of a short line its
                    boundaries cut, not counted (`view_cut_lines`).
* `evidence-fill`   the oracle's composition at the views' granularity: the
                    sink, the blocks of the question's evidence
                    (`answer_blocks`), then the latest history blocks up to
                    this view's size: fragments of the right turns, no
                    others.
* `lexical-hop`     the first probe's best `--fill-top` blocks (`probe_ranked`),
                    then the `--hop-blocks` history blocks that share the
                    rarest tokens with the first probe's best one (BM25 over
                    token ids, each block scored alone,
                    `index.lexical.block_scores` with no window), with
                    `--fill-passages P` each with its passage where that
                    spans at most P blocks, with `--fill-lines` the rest of
                    the lines their boundaries cut, then the latest history:
                    a second hop that follows a line to the name it points
                    to by that name's tokens.
* `drop-lookalikes` the probes' rankings taken in turn (`probe_ranked`; with
                    `--hop-blocks` > 0 the lexical hop from the lead lines
                    (`index.lookalikes`: the lead block with the rest of the
                    lines its boundaries cut) as the second, as
                    `probe_lexical_hop` takes it), the look-alikes of the
                    lead lines left out
                    (`index.lookalikes`, as `view_lookalikes` drop leaves
                    them), then the first `--fill-top` blocks with
                    `--fill-passages` and `--fill-lines` as in
                    `recency-fill`, then the latest history.
* `evidence-plus`   `evidence-fill` with `--extra` more of the view's own
                    selected blocks (drawn at random, sink and recent aside)
                    before the latest history: how many fragments of other
                    text a view can hold before the answer suffers.

    python benchmarks/fidelity/replay.py --model QWEN_DIR --runs RUN.jsonl [RUN.jsonl ...] \\
        --method views-rerank-rcall-ord:8192 --families vartrack,squad \\
        --variants as-run no-lookalikes [--fill-from views-rerank-rcall-ord:4096] \\
        [--fill-top 32 [--fill-context 1 | --fill-passages 8] [--fill-lines]] [--length 131072] [--out benchmarks/results/fidelity]

Each answered view is a line of `replay/trials.jsonl` under `--out` (kept
across calls; a trial already there is not answered again, and the command
that answered it goes into `replay/commands.txt`); `replay.md` and
`replay.json` are rebuilt from all of them on every call: per run, family
and variant, the answers with their 95% interval, paired with `as-run` on
the same questions of the same run (exact McNemar), and how often `as-run`
agreed with what the run's own view answered (`served`: on the GPU, or on
the CPU for a run served there). Needs vLLM's CPU build and the model's
weights; about 25 s per 8K view on 2 cores.
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import random
import re
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import report_header as H  # noqa: E402
import sessions as S  # noqa: E402
from corpora import Corpora  # noqa: E402
from report import read_trials, wilson  # noqa: E402
from vllm_sekv.index import lexical  # noqa: E402
from vllm_sekv.index.lookalikes import lead_block, lookalike_mask  # noqa: E402
from vllm_sekv.workspace.passages import Passages  # noqa: E402
from vllm_sekv.workspace.vocabulary import Vocabulary  # noqa: E402
from vllm_sekv.workspace.view_passes import choose_blocks  # noqa: E402

VARIANTS = ("as-run", "no-lookalikes", "separated", "recency-fill", "evidence-fill", "evidence-plus", "lexical-hop",
            "drop-lookalikes")
# Planted fact lines, whole or cut short by the end of a block.
PLANTED = {
    "multikey": re.compile(r"One of the special magic numbers for [a-z]+-[a-z]+ is: \d+\.?\n?"),
    "vartrack": re.compile(r"VAR [A-Z]{5} = (?:VAR [A-Z]{5}|\d+)\n?"),
}
SEPARATOR = "\n...\n"


def view_ids(prompt_ids: list[int], selected: list[int], block_tokens: int) -> list[int]:
    """The tokens of a view that held `selected` (every block of it, virtual
    order): those blocks, then the prompt after the last of them."""
    blocks = sorted(selected)
    ids = [t for b in blocks for t in prompt_ids[b * block_tokens:(b + 1) * block_tokens]]
    return ids + prompt_ids[(blocks[-1] + 1) * block_tokens:]


def separated_ids(prompt_ids: list[int], selected: list[int], block_tokens: int, separator: list[int]) -> list[int]:
    """`view_ids` with `separator` between blocks not adjacent in the history."""
    blocks = sorted(selected)
    ids: list[int] = []
    for i, b in enumerate(blocks):
        if i and b != blocks[i - 1] + 1:
            ids += separator
        ids += prompt_ids[b * block_tokens:(b + 1) * block_tokens]
    return ids + prompt_ids[(blocks[-1] + 1) * block_tokens:]


def recency_filled(selected: list[int], smaller: list[int]) -> list[int]:
    """`smaller`'s blocks (those before `selected`'s tail), then the latest
    history blocks before that tail, up to as many blocks as `selected`."""
    end = max(selected) + 1
    out = {b for b in smaller if b < end}
    b = end - 1
    while len(out) < len(selected) and b >= 0:
        out.add(b)
        b -= 1
    return sorted(out)


def top_blocks(ranked: list[int], top: int, context: int, lo: int, hi: int,
               passages: Passages | None = None, passage_blocks: int = 0,
               lines: Passages | None = None) -> list[int]:
    """The first `top` blocks that a selection with `context` neighbours per
    block (`view_context_blocks`), or with `passages` of up to `passage_blocks`
    blocks (`view_passage_blocks`), takes from `ranked` (best first), with
    `lines` the rest of the lines their boundaries cut too (`view_cut_lines`,
    not counted against `top`), those in `[lo, hi)` (the candidates: after
    the sink, before the recent window): `view_passes.choose_blocks`, as a
    view with `view_select_blocks` `top` takes them."""
    return choose_blocks(ranked, range(lo, hi), top, hi - lo, context, passages, passage_blocks, lines)


def lexical_hop(history: list[int], lead: tuple[int, int], lo: int, hi: int, n: int, block_tokens: int) -> list[int]:
    """The `n` blocks in `[lo, hi)` (those holding lead tokens aside) with the
    best BM25 score against the tokens `history[lead[0]:lead[1]]`, each block
    scored alone (`index.lexical.hop_scores`)."""
    candidates = np.arange(lo, hi)
    scores = lexical.hop_scores(np.asarray(history), lead, candidates, block_tokens)  # the lead's own: -inf
    return [int(candidates[i]) for i in np.argsort(-scores, kind="stable") if scores[i] > -np.inf][:n]


def lead_lines(history: list[int], lead: int, breaks, block_tokens: int) -> tuple[int, int]:
    """Block `lead`'s tokens with the rest of the lines its boundaries cut, as
    a view finds its lead lines (`index.lookalikes`)."""
    return Passages(history, breaks.lines(), block_tokens).line_span(lead)


def in_turn(rankings: list[list[int]]) -> list[int]:
    """The rankings' blocks taken in turn (the first's best, the second's
    best, ..., then each one's second), each at its first place: how a view
    interleaves its hops (`view_passes.interleave_hops` with no gain)."""
    out: dict[int, None] = {}
    for i in range(max(map(len, rankings), default=0)):
        for ranking in rankings:
            if i < len(ranking):
                out.setdefault(ranking[i])
    return list(out)


def without_lookalikes_of(history: list[int], query: list[int], ranked: list[int], lead: tuple[int, int], lo: int,
                          hi: int, block_tokens: int, lines: Passages | None = None,
                          words: np.ndarray | None = None, turns: np.ndarray | None = None) -> list[int]:
    """`ranked` (blocks in `[lo, hi)`, best first) without the look-alikes of
    the lead lines `lead` (`index.lookalikes.lookalike_mask` over every block in
    `[lo, hi)` as candidates, those of `ranked` first in its order, each
    judged by its lines where the history's `lines` are given, its tokens
    compared by `words` where given: `Vocabulary.words`, its question
    delimited by `turns` where given: `Vocabulary.turns`)."""
    candidates = list(range(lo, hi))
    first = [b - lo for b in ranked]
    order = first + sorted(set(range(hi - lo)) - set(first))
    spans = None if lines is None else lines.line_spans(np.asarray(candidates, dtype=np.int64))
    mask = lookalike_mask(np.asarray(history), candidates, order, lead, query, block_tokens, spans, words, turns)
    return [b for b in ranked if not mask[b - lo]]


def lookalike_ranking(prompt: list[int], trial: dict, vocab, hop: bool, sink_blocks: int, recent_blocks: int,
                      block_tokens: int) -> tuple[list[int], list[int]]:
    """(the probes' rankings of the trial's view taken in turn, the same
    without the lead lines' look-alikes), as a server with `view_lookalikes`
    drop ranks them: the trial's `probe_ranked`, with `hop` the lexical hop
    from the lead lines as the second, each judged by its lines
    (`without_lookalikes_of`); `vocab`: the tokenizer's `Vocabulary`."""
    selected = trial["selected_blocks"]
    lo, hi = sink_blocks, max(selected) + 1 - recent_blocks
    end = (max(selected) + 1) * block_tokens
    history, new = prompt[:end], prompt[end:]
    probes = [[b for b in p if lo <= b < hi] for p in trial["probe_ranked"]]
    lead = lead_lines(history, lead_block(history, probes[0], new, block_tokens), vocab.breaks, block_tokens)
    if hop:
        probes.insert(1, lexical_hop(history, lead, lo, hi, len(probes[0]), block_tokens))
    every_line = Passages(history, vocab.breaks.lines(), block_tokens)
    ranked = in_turn(probes)
    return ranked, without_lookalikes_of(history, new, ranked, lead, lo, hi, block_tokens, every_line, vocab.words,
                                         vocab.turns)


def drop_lookalikes_best(prompt: list[int], trial: dict, top: int, vocab, hop: bool, passage_blocks: int,
                         cut_lines: bool, sink_blocks: int, recent_blocks: int, block_tokens: int,
                         kept: list[int] | None = None) -> list[int]:
    """The sink and the best blocks of the trial's view rebuilt as a server
    with `view_lookalikes` drop selects them: `lookalike_ranking`'s ranking
    without look-alikes (`kept`, where the caller has it), then the first
    `top` blocks with their passages of up to `passage_blocks` blocks (0:
    alone) and, with `cut_lines`, the rest of the lines their boundaries cut
    (`top_blocks`). The latest history is not included (`recency_filled`
    adds it)."""
    selected = trial["selected_blocks"]
    lo, hi = sink_blocks, max(selected) + 1 - recent_blocks
    history = prompt[:(max(selected) + 1) * block_tokens]
    ranked = kept if kept is not None else lookalike_ranking(prompt, trial, vocab, hop, sink_blocks, recent_blocks,
                                                             block_tokens)[1]
    passages = Passages(history, vocab.breaks, block_tokens) if passage_blocks else None
    lines = Passages(history, vocab.breaks.lines(), block_tokens) if cut_lines else None
    return [b for b in selected if b < sink_blocks] + top_blocks(ranked, top, 0, lo, hi, passages, passage_blocks,
                                                                 lines)


def other_blocks(selected: list[int], best: list[int], recent_blocks: int, n: int, seed: str) -> list[int]:
    """`n` of `selected` (its last `recent_blocks` and `best` aside), drawn
    at random; the same for the same `seed`."""
    pool = sorted(set(sorted(selected)[:-recent_blocks]) - set(best))
    return sorted(random.Random(seed).sample(pool, min(n, len(pool))))


def is_evidence(fact: str, evidence: list[str]) -> bool:
    """Whether a planted fact's line (whole, or cut short by a block's end) is one of the question's evidence."""
    return any(e.startswith(fact) or fact.startswith(e) for e in evidence)


def planted_matches(tokenizer, ids: list[int], family: str) -> Iterator[re.Match]:
    """The family's planted facts (`PLANTED`) in the decoded history before
    the step's last user turn, in order: earlier questions and their gold
    replies are not searched."""
    text = tokenizer.decode(ids)
    end = text.rfind("<|im_start|>user")
    return PLANTED[family].finditer(text, 0, end if end >= 0 else len(text))


def without_lookalikes(tokenizer, ids: list[int], family: str, evidence: list[str]) -> tuple[list[int], int]:
    """(`ids` without the tokens of planted facts that are not a prefix of
    the question's evidence, how many facts went), `planted_matches`' facts."""
    drop = []
    for m in planted_matches(tokenizer, ids, family):
        fact = m.group(0).rstrip("\n")
        if not is_evidence(fact, evidence):
            drop.append((m.start(), m.end()))
    gone: set[int] = set()
    for a, b in drop:
        gone.update(range(S.token_at(tokenizer, ids, a), S.token_at(tokenizer, ids, b - 1) + 1))
    return [t for i, t in enumerate(ids) if i not in gone], len(drop)


def variant_label(variant: str, fill_top: int | None, fill_from: str | None, extra: int, context: int = 0,
                  passage_blocks: int = 0, cut_lines: bool = False) -> str:
    """The name a variant's trials are stored and reported under."""
    if variant == "evidence-plus":
        return f"{variant}:{extra}"
    if variant == "drop-lookalikes":
        return f"{variant}:top{fill_top}" + ("+lexhop" if extra else "") + \
            (f"+psg{passage_blocks}" if passage_blocks else "") + ("+lines" if cut_lines else "")
    if variant == "lexical-hop":
        return f"{variant}:top{fill_top}+lex{extra}" + (f"+psg{passage_blocks}" if passage_blocks else "") + \
            ("+lines" if cut_lines else "")
    if variant != "recency-fill":
        return variant
    if fill_top is None:
        return f"{variant}:{fill_from}"
    return f"{variant}:top{fill_top}" + (f"+ctx{context}" if context else "") + \
        (f"+psg{passage_blocks}" if passage_blocks else "") + ("+lines" if cut_lines else "")


def mcnemar(gained: int, lost: int) -> float:
    """Two-sided exact McNemar p-value of `gained` against `lost` discordant pairs."""
    n = gained + lost
    if n == 0:
        return 1.0
    k = min(gained, lost)
    p = 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return round(min(1.0, p), 4)


def summarize(trials: list[dict]) -> list[dict]:
    """One row per (run, family, method, variant): answers, interval, pairing with `as-run`."""
    by = collections.defaultdict(dict)
    for t in trials:
        by[(t["run"], t["family"], t["method"], t["variant"])][(t["seed"], t["question"])] = t
    rows = []
    for (run, family, method, variant), cell in sorted(by.items()):
        n, k = len(cell), sum(t["correct"] for t in cell.values())
        held = [t for t in cell.values() if t.get("evidence_in_view")]
        row = {"run": run, "family": family, "method": method, "variant": variant, "n": n, "correct": k,
               "accuracy": round(k / n, 4), "ci95": list(wilson(k, n)),
               "served_correct": sum(t["served_correct"] for t in cell.values()),
               "n_evidence_in_view": len(held), "correct_evidence_in_view": sum(t["correct"] for t in held)}
        base = by.get((run, family, method, "as-run"), {})
        if variant == "as-run":
            row["same_answer_as_served"] = sum(t["response"].strip() == t["served_response"].strip()
                                               for t in cell.values())
        elif base:
            pairs = [(cell[q]["correct"], base[q]["correct"]) for q in cell if q in base]
            row["paired_n"] = len(pairs)
            row["gained"] = sum(a and not b for a, b in pairs)
            row["lost"] = sum(b and not a for a, b in pairs)
            row["p"] = mcnemar(row["gained"], row["lost"])
        rows.append(row)
    # families pooled, per run, method and variant
    pooled = collections.defaultdict(list)
    for r in rows:
        pooled[(r["run"], r["method"], r["variant"])].append(r)
    for (run, method, variant), rs in sorted(pooled.items()):
        if len(rs) < 2:
            continue
        n, k = sum(r["n"] for r in rs), sum(r["correct"] for r in rs)
        row = {"run": run, "family": "all", "method": method, "variant": variant, "n": n, "correct": k,
               "accuracy": round(k / n, 4), "ci95": list(wilson(k, n)),
               "served_correct": sum(r["served_correct"] for r in rs),
               "n_evidence_in_view": sum(r["n_evidence_in_view"] for r in rs),
               "correct_evidence_in_view": sum(r["correct_evidence_in_view"] for r in rs)}
        if "gained" in rs[0]:
            row["gained"], row["lost"] = sum(r.get("gained", 0) for r in rs), sum(r.get("lost", 0) for r in rs)
            row["p"] = mcnemar(row["gained"], row["lost"])
        rows.append(row)
    return rows


def markdown(rows: list[dict], meta: dict) -> list[str]:
    lines = H.header_from(meta, "Fidelity: recorded views replayed on the CPU") + [
        "Each view rebuilt from a run's `selected_blocks` (every block recomputed in virtual order, so the view "
        "is a prefill of its tokens), changed as the variant says, answered greedily by vLLM on the CPU. "
        "`run`: the trial lines whose views are replayed (`runs/`; `cpu-` runs were served by vLLM on this "
        "machine's CPU, the others on the GPU); `served` is what the run's own view answered on the same "
        "questions; `same as served` counts `as-run` answers equal to it, text for text; `where the view held "
        "it`: the questions whose served view held the evidence (`answer_in_view`), correct of them. Paired "
        "with `as-run` on the same questions of the same run (exact McNemar).", "",
        "| run | family | method | variant | n | correct | accuracy (95% CI) | where the view held it | served "
        "| same as served | gained / lost vs as-run (p) |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        paired = f"+{r['gained']} -{r['lost']} ({r['p']})" if "gained" in r else "-"
        lines.append(f"| {r['run']} | {r['family']} | `{r['method']}` | {r['variant']} | {r['n']} | {r['correct']} | "
                     f"{r['accuracy']:.2f} ({r['ci95'][0]:.2f}-{r['ci95'][1]:.2f}) | "
                     f"{r['correct_evidence_in_view']}/{r['n_evidence_in_view']} | {r['served_correct']} | "
                     f"{r.get('same_answer_as_served', '-')} | {paired} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the evaluated model's folder")
    ap.add_argument("--runs", nargs="+", required=True,
                    help="trial lines; each run's views are replayed and reported apart")
    ap.add_argument("--method", default="views-rerank-rcall-ord:8192",
                    help="a views method whose every selected block was recomputed in order")
    ap.add_argument("--families", default="vartrack,multikey")
    ap.add_argument("--length", type=int, default=131072)
    ap.add_argument("--variants", nargs="+", default=["as-run", "no-lookalikes"], choices=VARIANTS)
    ap.add_argument("--fill-from", default=None, help="recency-fill: the smaller view's method")
    ap.add_argument("--fill-top", type=int, default=None, help="recency-fill: this many of the ranked blocks")
    ap.add_argument("--fill-context", type=int, default=0,
                    help="recency-fill with --fill-top: neighbours on each side of each ranked block")
    ap.add_argument("--fill-passages", type=int, default=0,
                    help="recency-fill with --fill-top: each ranked block with its passage where that spans "
                         "at most this many blocks (view_passage_blocks), instead of neighbours")
    ap.add_argument("--fill-lines", action="store_true",
                    help="recency-fill with --fill-top: each ranked block with the rest of the lines its "
                         "boundaries cut (view_cut_lines), not counted against --fill-top")
    ap.add_argument("--sink-blocks", type=int, default=2, help="the views' sink, in blocks (sink_tokens 64)")
    ap.add_argument("--recent-blocks", type=int, default=8, help="the views' recent window (recent_tokens 256)")
    ap.add_argument("--extra", type=int, default=32, help="evidence-plus: this many other selected blocks")
    ap.add_argument("--hop-blocks", type=int, default=2,
                    help="lexical-hop: this many blocks of the lexical hop; drop-lookalikes: 0 for the probes' "
                         "rankings alone, else the lexical hop's among them")
    ap.add_argument("--block-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=24, help="as the evaluation's servers answered (run.py)")
    ap.add_argument("--out", default=str(H.results_dir("fidelity")))
    args = ap.parse_args()
    if not args.method.split(":")[0].endswith("-rcall-ord"):
        ap.error("--method: only a view whose every selected block is recomputed in order replays exactly")
    if "recency-fill" in args.variants and (args.fill_from is None) == (args.fill_top is None):
        ap.error("--variants recency-fill needs one of --fill-from and --fill-top")
    for needs_top in ("lexical-hop", "drop-lookalikes"):
        if needs_top in args.variants and args.fill_top is None:
            ap.error(f"--variants {needs_top} needs --fill-top")
    families = args.families.split(",")

    def label(variant: str) -> str:
        extra = args.hop_blocks if variant in ("lexical-hop", "drop-lookalikes") else args.extra
        return variant_label(variant, args.fill_top, args.fill_from, extra, args.fill_context,
                             args.fill_passages, args.fill_lines)
    for f in families:
        if "no-lookalikes" in args.variants and f not in PLANTED:
            ap.error(f"--families {f}: no-lookalikes knows the planted facts of {', '.join(PLANTED)} only")

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    vocab = Vocabulary.of(tokenizer) if args.fill_passages or args.fill_lines or "drop-lookalikes" in args.variants \
        else None
    breaks = None if vocab is None else vocab.breaks
    trials = {(Path(path).stem, *key): r for path in args.runs for key, r in read_trials([path]).items()}
    out_dir = Path(args.out)
    store = out_dir / "replay" / "trials.jsonl"
    store.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if store.exists():
        for line in store.read_text().splitlines():
            t = json.loads(line)
            done.add((t["run"], t["family"], t["seed"], t["question"], t["method"], t["variant"]))

    corpora, sessions = Corpora(), {}
    jobs = []  # (trial, variant, ids, note)
    separator = tokenizer(SEPARATOR, add_special_tokens=False)["input_ids"]
    for key, r in sorted(trials.items()):
        run, family, length, seed, q, method = key
        if family not in families or length != args.length or method != args.method or not r.get("selected_blocks"):
            continue
        todo = [v for v in args.variants
                if (run, family, seed, q, method, label(v)) not in done]
        if not todo:
            continue
        if (family, seed) not in sessions:
            sessions[family, seed] = S.generate(family, length, seed, tokenizer, corpora)
        session = sessions[family, seed]
        prompt = S.render_ids(tokenizer, session.step_messages(q))
        selected = r["selected_blocks"]
        for variant in todo:
            note = {}
            if variant == "as-run":
                ids = view_ids(prompt, selected, args.block_tokens)
            elif variant == "separated":
                ids = separated_ids(prompt, selected, args.block_tokens, separator)
            elif variant == "no-lookalikes":
                ids, note["facts_dropped"] = without_lookalikes(
                    tokenizer, view_ids(prompt, selected, args.block_tokens), family, session.questions[q].evidence)
            elif variant == "lexical-hop":
                if not r.get("probe_ranked"):
                    continue
                lo, hi = args.sink_blocks, max(selected) + 1 - args.recent_blocks
                history = prompt[: (max(selected) + 1) * args.block_tokens]
                first = [b for b in r["probe_ranked"][0] if lo <= b < hi][: args.fill_top]
                alone = (first[0] * args.block_tokens, (first[0] + 1) * args.block_tokens)  # the block alone
                hop = [b for b in lexical_hop(history, alone, lo, hi, args.hop_blocks + len(first),
                                              args.block_tokens) if b not in first][: args.hop_blocks]
                passages = Passages(history, breaks, args.block_tokens) if args.fill_passages else None
                lines = Passages(history, breaks.lines(), args.block_tokens) if args.fill_lines else None
                best = [b for b in selected if b < args.sink_blocks] + top_blocks(  # each with its passage whole
                    first + hop, hi - lo, 0, lo, hi, passages, args.fill_passages, lines)
                ids = view_ids(prompt, recency_filled(selected, best), args.block_tokens)
            elif variant == "drop-lookalikes":
                if not r.get("probe_ranked"):
                    continue
                best = drop_lookalikes_best(prompt, r, args.fill_top, vocab, args.hop_blocks > 0, args.fill_passages,
                                            args.fill_lines, args.sink_blocks, args.recent_blocks, args.block_tokens)
                ids = view_ids(prompt, recency_filled(selected, best), args.block_tokens)
            elif variant in ("evidence-fill", "evidence-plus"):
                if not r.get("answer_blocks"):
                    continue
                best = [b for b in selected if b < args.sink_blocks] + r["answer_blocks"]
                if variant == "evidence-plus":
                    best += other_blocks(selected, best, args.recent_blocks, args.extra, f"{family}/{seed}/{q}")
                ids = view_ids(prompt, recency_filled(selected, best), args.block_tokens)
            else:
                if args.fill_top is not None:
                    if not r.get("ranked_blocks"):
                        continue
                    candidates = (args.sink_blocks, max(selected) + 1 - args.recent_blocks)
                    history = prompt[: (max(selected) + 1) * args.block_tokens]
                    passages = Passages(history, breaks, args.block_tokens) if args.fill_passages else None
                    lines = Passages(history, breaks.lines(), args.block_tokens) if args.fill_lines else None
                    best = [b for b in selected if b < args.sink_blocks] + top_blocks(
                        r["ranked_blocks"], args.fill_top, args.fill_context, *candidates, passages,
                        args.fill_passages, lines)
                else:
                    smaller = trials.get((run, family, length, seed, q, args.fill_from))
                    if smaller is None or not smaller.get("selected_blocks"):
                        continue
                    best = smaller["selected_blocks"]
                ids = view_ids(prompt, recency_filled(selected, best), args.block_tokens)
            jobs.append((run, r, label(variant), ids, note))
    print(f"[replay] {len(jobs)} views to answer", flush=True)
    if jobs:
        with (store.parent / "commands.txt").open("a") as f:
            f.write(H.command(__file__) + "\n")
        answer(jobs, sessions, store, args)
    write_report(store, out_dir)


def answer(jobs: list[tuple], sessions: dict, store: Path, args) -> None:
    """Answer each job's view greedily with vLLM on the CPU; one line per view into `store`."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # a view's KV is a few hundred MB: a 2 GiB cache leaves the machine's memory to other work
    llm = LLM(args.model, max_model_len=max(len(j[3]) for j in jobs) + args.max_tokens, enforce_eager=True,
              dtype="bfloat16", enable_prefix_caching=False,  # as the GPU's servers ran it
              kv_cache_memory_bytes=2 << 30)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    for i, (run, r, variant, ids, note) in enumerate(jobs):
        started = time.monotonic()
        text = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0].outputs[0].text
        session = sessions[r["family"], r["seed"]]
        row = {"run": run, "family": r["family"], "history_tokens": r["history_tokens"], "seed": r["seed"],
               "question": r["question"], "method": r["method"], "variant": variant,
               "correct": S.is_correct(session.questions[r["question"]], text), "response": text,
               "served_correct": r["correct"], "served_response": r["response"], "view_tokens": len(ids),
               "evidence_in_view": r.get("answer_in_view"),
               "evidence_rank": evidence_rank(r), "seconds": round(time.monotonic() - started, 1), **note}
        with store.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"[replay] {i + 1}/{len(jobs)} {run} {r['family']}-{r['seed']} q{r['question']} {variant:<14} "
              f"{'ok ' if row['correct'] else 'BAD'} served={'ok ' if r['correct'] else 'BAD'} {text[:30]!r}",
              flush=True)


def evidence_rank(trial: dict) -> int | None:
    """How many of a trial's `ranked_blocks` (best first) a selection must
    take to hold every block of the evidence (`answer_blocks`); None where
    the run recorded no ranking or the ranking lacks one of them."""
    ranked, evidence = trial.get("ranked_blocks"), trial.get("answer_blocks")
    if not ranked or not evidence or not set(evidence) <= set(ranked):
        return None
    return 1 + max(ranked.index(b) for b in evidence)


RANK_CUTS = (16, 32, 64, 128)


def evidence_ranks(trials: list[dict]) -> list[dict]:
    """Per run and family whose trials carry `evidence_rank`: of its
    questions, how many hold their whole evidence within the best K ranked
    blocks, for each K of RANK_CUTS and for the whole selection."""
    by = collections.defaultdict(dict)
    for t in trials:
        if "evidence_rank" in t:
            by[(t["run"], t["family"], t["method"])][(t["seed"], t["question"])] = t["evidence_rank"]
    rows = []
    for (run, family, method), ranks in sorted(by.items()):
        known = [k for k in ranks.values() if k is not None]
        rows.append({"run": run, "family": family, "method": method, "n": len(ranks),
                     "within": {str(cut): sum(k <= cut for k in known) for cut in RANK_CUTS},
                     "within_selection": len(known), "ranks": sorted(known)})
    return rows


def write_report(store: Path, out_dir: Path) -> None:
    """`replay.json` and `replay.md` from every stored trial, headed by the
    commands that answered them."""
    if not store.exists():
        return
    trials = [json.loads(line) for line in store.read_text().splitlines()]
    rows, ranks = summarize(trials), evidence_ranks(trials)
    commands = store.parent / "commands.txt"
    meta = H.meta(commands.read_text().splitlines() if commands.exists() else [H.command(__file__)])
    (out_dir / "replay.json").write_text(json.dumps({"meta": meta, "rows": rows, "evidence_ranks": ranks},
                                                    indent=1) + "\n")
    lines = markdown(rows, meta)
    if ranks:
        lines += ["", "Where the selection ranked the evidence (runs that recorded `ranked_blocks`): of each "
                  "cell's questions, those whose evidence blocks all rank within the best K.", "",
                  "| run | family | method | n | " + " | ".join(f"best {k}" for k in RANK_CUTS)
                  + " | in the selection | ranks needed |",
                  "|---|---|---|---|" + "---|" * (len(RANK_CUTS) + 2)]
        for r in ranks:
            lines.append(f"| {r['run']} | {r['family']} | `{r['method']}` | {r['n']} | "
                         + " | ".join(str(r["within"][str(k)]) for k in RANK_CUTS)
                         + f" | {r['within_selection']} | {', '.join(map(str, r['ranks']))} |")
    H.write_report(out_dir / "replay.md", lines)


if __name__ == "__main__":
    main()
