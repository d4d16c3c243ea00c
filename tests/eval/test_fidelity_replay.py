"""Rebuilding and changing recorded views (benchmarks/fidelity/replay.py):
the tokens a view held, its variants and the pairing of their answers. The
answering itself (vLLM on the CPU) is the script's run, not a test."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

FIDELITY = Path(__file__).resolve().parents[2] / "benchmarks" / "fidelity"


@pytest.fixture(scope="module")
def replay():
    sys.path.insert(0, str(FIDELITY))
    spec = importlib.util.spec_from_file_location("fidelity_replay", FIDELITY / "replay.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_view_is_its_blocks_in_order_then_the_prompt_after_the_last(replay):
    prompt = list(range(100, 140))  # ten blocks of four, and no tail block boundary issue
    assert replay.view_ids(prompt, [8, 0, 3, 9], 4) == (
        prompt[0:4] + prompt[12:16] + prompt[32:36] + prompt[36:40])
    # a prompt that goes on after the last selected block: the rest comes whole
    assert replay.view_ids(prompt, [0, 6], 4) == prompt[0:4] + prompt[24:]


def test_separators_go_between_blocks_apart_in_the_history_only(replay):
    prompt = list(range(40))
    ids = replay.separated_ids(prompt, [0, 1, 5, 9], 4, [-1])
    assert ids == prompt[0:8] + [-1] + prompt[20:24] + [-1] + prompt[36:40]


def test_recency_fill_keeps_the_smaller_views_blocks_and_takes_the_latest_others(replay):
    selected = [0, 1, 10, 20, 30, 40, 41, 42]  # eight blocks, the last is the tail's
    smaller = [0, 1, 20, 42]
    filled = replay.recency_filled(selected, smaller)
    assert len(filled) == len(selected) and set(smaller) <= set(filled)
    assert filled == [0, 1, 20, 38, 39, 40, 41, 42]
    # blocks of the smaller view past this view's last block are not history here
    assert 50 not in replay.recency_filled(selected, smaller + [50])


def test_exact_mcnemar(replay):
    assert replay.mcnemar(0, 0) == 1.0
    assert replay.mcnemar(5, 5) == 1.0
    assert replay.mcnemar(9, 1) == pytest.approx(0.0215, abs=1e-4)  # 2 * 11 / 1024
    assert replay.mcnemar(1, 9) == replay.mcnemar(9, 1)


def test_lookalikes_go_and_the_asked_facts_stay_even_cut_short(replay, model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    history = ("Some essay text here.\nVAR ABCDE = 12345\nmore text\nVAR FGHIJ = 67890\n"
               "and VAR KLMNO = VAR ABCDE\nthen VAR PQRST = VAR FGHIJ\nVAR UVWXY = 1\nend of the turn.")
    question = "<|im_start|>user\nwhat number does VAR KLMNO hold?"
    ids = tokenizer(history + question, add_special_tokens=False)["input_ids"]
    evidence = ["VAR ABCDE = 12345", "VAR KLMNO = VAR ABCDE"]
    kept, dropped = replay.without_lookalikes(tokenizer, ids, "vartrack", evidence)
    text = tokenizer.decode(kept)
    assert dropped == 3
    assert "VAR ABCDE = 12345" in text and "VAR KLMNO = VAR ABCDE" in text
    assert "FGHIJ" not in text and "PQRST" not in text and "UVWXY" not in text
    assert "Some essay text here." in text and "end of the turn." in text and text.endswith(question[-30:])
    # a fact cut short by a block's end is still the asked one
    cut = tokenizer("text\nVAR ABCDE = 123", add_special_tokens=False)["input_ids"]
    assert replay.without_lookalikes(tokenizer, cut, "vartrack", evidence)[1] == 0


def test_pairing_counts_gains_and_losses_against_as_run_of_the_same_run(replay):
    def t(variant, q, correct, run="h200"):
        return {"run": run, "family": "vartrack", "method": "views-rerank-rcall-ord:8192", "variant": variant,
                "seed": 0, "question": q, "correct": correct, "served_correct": q == 0, "response": "1",
                "served_response": "1"}

    trials = [t("as-run", 0, True), t("as-run", 1, False), t("as-run", 2, False),
              t("no-lookalikes", 0, False), t("no-lookalikes", 1, True), t("no-lookalikes", 2, True),
              t("as-run", 0, False, "cpu"), t("no-lookalikes", 0, True, "cpu")]  # another run of the same questions
    rows = {(r["run"], r["variant"]): r for r in replay.summarize(trials)}
    assert rows["h200", "as-run"]["correct"] == 1 and rows["h200", "as-run"]["same_answer_as_served"] == 3
    assert (rows["h200", "no-lookalikes"]["gained"], rows["h200", "no-lookalikes"]["lost"]) == (2, 1)
    assert rows["h200", "no-lookalikes"]["served_correct"] == 1
    assert (rows["cpu", "no-lookalikes"]["gained"], rows["cpu", "no-lookalikes"]["lost"]) == (1, 0)


def test_extra_blocks_come_from_the_selection_without_its_recent_window_or_the_evidence(replay):
    selected = list(range(0, 40, 2)) + [40, 41, 42, 43]  # the last four: the recent window
    best = [0, 2, 10]
    extra = replay.other_blocks(selected, best, recent_blocks=4, n=5, seed="vartrack/5/1")
    assert len(extra) == 5 and extra == sorted(extra)
    assert not set(extra) & {0, 2, 10, 40, 41, 42, 43} and set(extra) <= set(selected)
    assert extra == replay.other_blocks(selected, best, 4, 5, "vartrack/5/1")  # the same draw again
    assert len(replay.other_blocks(selected, best, 4, 100, "x")) == 20 - 3  # no more than there are


@pytest.mark.parametrize("top, context", [(3, 0), (5, 1), (4, 2)])
def test_the_best_blocks_are_those_a_limited_selection_takes(replay, top, context):
    """`top_blocks` over a full selection's `ranked_blocks` gives the blocks
    that a view with `view_select_blocks` and `view_context_blocks` selects."""
    from vllm_sekv.workspace.view_passes import ViewBudget, final_pass, first_pass

    budget = ViewBudget(block_tokens=8, view_tokens=160, sink_tokens=8, recent_tokens=16)
    probe = first_pass(40 * 8 + 3, matched_blocks=40, budget=budget)
    scores = [float((7 * i) % 11) for i in range(len(probe.candidates))]
    full = final_pass(probe, scores, budget)
    limited = final_pass(probe, scores, budget, context, select_blocks=top)
    lo, hi = probe.candidates[0], probe.candidates[-1] + 1
    assert replay.top_blocks(list(full.ranked), top, context, lo, hi) == list(limited.ranked)


@pytest.mark.parametrize("top", [4, 9])
def test_the_best_blocks_with_passages_are_those_a_limited_selection_takes(replay, top):
    """`top_blocks` with passages gives the blocks that a view with
    `view_select_blocks` and `view_passage_blocks` selects."""
    import numpy as np
    from vllm_sekv.workspace.passages import BreakTokens, Passages
    from vllm_sekv.workspace.view_passes import ViewBudget, final_pass, first_pass

    budget = ViewBudget(block_tokens=8, view_tokens=160, sink_tokens=8, recent_tokens=16)
    history = [5] * (40 * 8)
    for end in (30, 70, 150, 160, 250, 290):  # passages of 1 to 12 blocks
        history[end] = 999
    breaks = BreakTokens(whole=np.array([999]), closes=np.array([], dtype=np.int64),
                         opens=np.array([], dtype=np.int64))
    passages = Passages(history, breaks, 8)
    probe = first_pass(len(history) + 3, matched_blocks=40, budget=budget)
    scores = [float((7 * i) % 11) for i in range(len(probe.candidates))]
    full = final_pass(probe, scores, budget)
    limited = final_pass(probe, scores, budget, passages=passages, passage_blocks=6, select_blocks=top)
    lo, hi = probe.candidates[0], probe.candidates[-1] + 1
    picked = replay.top_blocks(list(full.ranked), top, 0, lo, hi, passages, 6)
    assert picked == list(limited.ranked) and len(picked) == top
    assert picked != replay.top_blocks(list(full.ranked), top, 0, lo, hi)  # the passages changed the pick
    lines = Passages(history, breaks.lines(), 8)  # the same breaks as lines: 30..70 is not short, 150..160 is
    with_lines = final_pass(probe, scores, budget, select_blocks=top, lines=lines)
    picked = replay.top_blocks(list(full.ranked), top, 0, lo, hi, lines=lines)
    assert picked == list(with_lines.ranked) and len(picked) >= top


def test_the_evidence_rank_is_how_far_down_the_ranking_its_last_block_sits(replay):
    assert replay.evidence_rank({"ranked_blocks": [9, 4, 7, 2], "answer_blocks": [7, 9]}) == 3
    assert replay.evidence_rank({"ranked_blocks": [9, 4], "answer_blocks": [7, 9]}) is None  # not all ranked
    assert replay.evidence_rank({"answer_blocks": [7]}) is None  # no ranking recorded
    trials = [{"run": "cpu", "family": "vartrack", "method": "m", "seed": 0, "question": q, "evidence_rank": k}
              for q, k in enumerate([3, 40, None, 100])]
    (row,) = replay.evidence_ranks(trials + [{**trials[0], "variant": "other"}])  # a question counts once
    assert row["n"] == 4 and row["within"] == {"16": 1, "32": 1, "64": 2, "128": 3}
    assert row["within_selection"] == 3 and row["ranks"] == [3, 40, 100]


def test_the_lexical_hop_follows_the_query_blocks_rare_tokens_and_never_returns_it(replay):
    bt = 4
    history = [7] * (bt * 20)  # a common token everywhere
    history[5 * bt:6 * bt] = [7, 901, 902, 7]  # the query block: two rare tokens
    history[12 * bt:13 * bt] = [902, 7, 7, 7]  # shares one of them
    history[15 * bt:16 * bt] = [901, 902, 7, 7]  # shares both
    assert replay.lexical_hop(history, (5 * bt, 6 * bt), 2, 18, 2, bt) == [15, 12]
    assert replay.lexical_hop(history, (5 * bt, 6 * bt), 2, 14, 1, bt) == [12]  # only candidates in [lo, hi)
    assert 6 not in replay.lexical_hop(history, (5 * bt, 6 * bt + 1), 2, 18, 16, bt)  # the lead lines' own blocks
    assert replay.variant_label("lexical-hop", 1, None, 2, cut_lines=True) == "lexical-hop:top1+lex2+lines"
