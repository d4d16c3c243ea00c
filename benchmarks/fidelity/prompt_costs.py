"""What a long prompt costs before and beside a view's passes, on this
machine's CPU: rendering and tokenizing the whole chat prompt (as plain
vLLM's API server does, inside its time to first token), the same through a
sekv server's `PromptTokenCache` holding the session's previous step, and
scoring every history block lexically (`vllm_sekv.index.lexical.block_scores`,
what `lexical_weight` adds to a view step on the scheduler thread).

    python benchmarks/fidelity/prompt_costs.py --model QWEN_DIR [--family multikey] \\
        [--lengths 30720,131072] [--repeats 5] [--out benchmarks/results/fidelity]

One fidelity session per length (seed 0), its second question's prompt
(the first question's is the step before); each figure is the median of
`--repeats` runs. Writes `prompt_costs.json` and `prompt_costs.md`.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parents[1]))
import report_header as H  # noqa: E402
import sessions as S  # noqa: E402
from corpora import Corpora  # noqa: E402

from vllm_sekv.index import lexical  # noqa: E402
from vllm_sekv.prompt_tokens import reuse_prompt_tokens  # noqa: E402


def median_seconds(fn, repeats: int, timed_last: bool = False) -> float:
    """The median time of `fn()`; with `timed_last`, `fn` returns a function
    (made untimed) and its call is what is timed."""
    times = []
    for _ in range(repeats):
        call = fn() if timed_last else fn
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def render_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt's ids as vLLM's renderer asks for them."""
    cont = messages[-1]["role"] == "assistant"
    return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False,
                                         add_generation_prompt=not cont, continue_final_message=cont)


def reused_step(tokenizer, before: list[dict], messages: list[dict], ids: list[int]):
    """A sekv server's tokenizer that has served `before` (untimed), and the
    call that renders `messages` through it (checked against `ids`)."""
    tok = copy.copy(tokenizer)
    reuse_prompt_tokens(tok)
    render_ids(tok, before)

    def step() -> None:
        assert render_ids(tok, messages) == ids
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the evaluated model's folder (its tokenizer and chat template)")
    ap.add_argument("--family", default="multikey")
    ap.add_argument("--lengths", default="30720,131072")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--block-tokens", type=int, default=32)
    ap.add_argument("--out", default=str(H.results_dir("fidelity")))
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    corpora, rows = Corpora(), []
    for length in map(int, args.lengths.split(",")):
        session = S.generate(args.family, length, 0, tokenizer, corpora)
        before, messages = session.step_messages(0), session.step_messages(1)
        text = S.render_text(tokenizer, messages)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        start = len(S.render_ids(tokenizer, messages[:-1])) // args.block_tokens * args.block_tokens
        rows.append({
            "family": args.family, "history_tokens": length, "prompt_tokens": len(ids),
            "tokenize_s": round(median_seconds(lambda: render_ids(tokenizer, messages), args.repeats), 4),
            "tokenize_reused_s": round(median_seconds(lambda: reused_step(tokenizer, before, messages, ids),
                                                      args.repeats, timed_last=True), 4),
            "lexical_scores_s": round(median_seconds(
                lambda: lexical.block_scores(np.asarray(ids[:start], dtype=np.int64), ids[start:],
                                             args.block_tokens), args.repeats), 4),
        })
        print(json.dumps(rows[-1]), flush=True)
    meta = H.meta([H.command(__file__)])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prompt_costs.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = H.header_from(meta, "Fidelity: what a long prompt costs beside a view's passes") + [
        f"One `{args.family}` session per length, its second question's chat prompt; medians of "
        f"{args.repeats} runs on this machine's CPU. *Tokenize*: "
        "the chat template rendered and the whole prompt tokenized (`apply_chat_template`, as vLLM's API "
        "server does before its time-to-first-token clock reaches the engine). *Tokenize, sekv*: the same "
        "call on a sekv server, whose `PromptTokenCache` holds the session's previous step (the first "
        "question's prompt); the ids are checked equal. *Lexical scores*: `lexical.block_scores` over the "
        "history against the question (what `lexical_weight` adds per view step).",
        "", "| history tokens | prompt tokens | tokenize s | tokenize, sekv s | lexical scores s |",
        "|---|---|---|---|---|"]
    lines += [f"| {r['history_tokens']} | {r['prompt_tokens']} | {r['tokenize_s']:.3f} | "
              f"{r['tokenize_reused_s']:.4f} | {r['lexical_scores_s']:.4f} |" for r in rows]
    H.write_report(out / "prompt_costs.md", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
