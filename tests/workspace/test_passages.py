"""Passages (`workspace.passages`): the break tokens of a real tokenizer, the
passages of a history in whole blocks, and a view whose selected blocks bring
their passages (`final_pass` with `passage_blocks`) or the rest of the short
lines their boundaries cut (`final_pass` with `lines`)."""
import numpy as np
import pytest
from transformers import AutoTokenizer

from vllm_sekv.workspace.passages import BreakTokens, Passages, break_token_ids
from vllm_sekv.workspace.view_passes import ViewBudget, final_pass, first_pass

BREAK = 7  # the one break token of the synthetic histories below
SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # its chat template's
SYNTHETIC = BreakTokens(np.array([BREAK]), np.array([], dtype=np.int64), np.array([], dtype=np.int64))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def test_a_chat_histories_breaks_are_its_turn_boundaries_and_blank_lines(tokenizer):
    breaks = break_token_ids(tokenizer)
    text = tokenizer.apply_chat_template([
        {"role": "system", "content": "Be careful."},
        {"role": "user", "content": "Document 1:\nAlpha beta.\n\nDocument 2:\nGamma.\n\n\ndef f(x=3):\n    return x\n"},
    ], tokenize=False)
    ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"])
    at = breaks.positions(ids)
    pieces = [tokenizer.decode(ids[a + 1 : b + 1]) for a, b in zip([-1, *at[:-1]], at)]
    assert pieces == ["<|im_start|>", "system\nBe careful.<|im_end|>", "\n<|im_start|>",
                      "user\nDocument 1:\nAlpha beta.\n\n", "Document 2:\nGamma.\n\n\n",
                      "def f(x=3):\n    return x\n<|im_end|>"]


def test_a_histories_lines_end_at_every_newline_and_special_token(tokenizer):
    lines = break_token_ids(tokenizer).lines()
    text = tokenizer.apply_chat_template([
        {"role": "user", "content": "VAR ABC = 5\nVAR DEF = VAR ABC\n\nThe grass is green.\ndef f():\n    return 1"},
    ], tokenize=False)
    ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"])
    at = lines.positions(ids)
    pieces = [tokenizer.decode(ids[a + 1 : b + 1]) for a, b in zip([-1, *at[:-1]], at)]
    # a run of breaks is one (a turn's end, newline and next start); a newline token with indentation
    # ends the line it closes
    assert pieces == ["<|im_start|>", "system\n", f"{SMOL_SYSTEM}<|im_end|>\n<|im_start|>", "user\n", "VAR ABC = 5\n",
                      "VAR DEF = VAR ABC\n\n", "The grass is green.\n", "def f():\n   ", " return 1<|im_end|>\n"]


def test_a_block_completes_a_line_its_boundary_cuts_when_the_line_spans_just_the_two_blocks():
    # 4-token blocks; line breaks at tokens 5, 9, 11 and 22: lines 0..5, 6..9, 10..11, 12..22, 23..31
    history = np.ones(32, dtype=np.int64)
    history[[5, 9, 11, 22]] = BREAK
    p = Passages(history, SYNTHETIC, block_tokens=4)
    # line 6..9 crosses blocks 1|2, line 10..11 sits inside block 2, line 0..5 crosses 0|1,
    # line 12..22 spans blocks 3..5, line 23..31 spans 5..7
    assert [p.cut(b) for b in range(8)] == [[1], [0, 2], [1], [], [], [], [], []]
    # the same in tokens: a block's own tokens with the rest of those lines
    assert [p.line_span(b) for b in range(8)] == [(0, 6), (0, 10), (6, 12), (12, 16), (16, 20), (20, 24),
                                                  (24, 28), (28, 32)]
    assert p.line_spans(np.arange(8)).tolist() == [list(p.line_span(b)) for b in range(8)]  # all at once
    assert p.line_spans(np.array([2, 0])).tolist() == [[6, 12], [0, 6]]
    for method in (p.cut, p.line_span):
        with pytest.raises(ValueError, match="outside"):
            method(8)
    with pytest.raises(ValueError, match="inside"):
        p.line_spans(np.array([3, 8]))


def test_a_views_cut_lines_come_along_uncounted_by_the_selection_limit_within_the_room():
    budget = ViewBudget(block_tokens=8, view_tokens=96, sink_tokens=8, recent_tokens=16)  # 12 blocks
    history = np.arange(1000, 1200) % 5 + 10  # 25 blocks
    history[[8 * 10 - 3, 8 * 10 + 2, 8 * 15 + 1, 8 * 16 + 6]] = BREAK  # lines 77..82 (blocks 9|10), 122..134 (15|16)
    prompt = history.tolist() + [1, 2, 3]
    probe = first_pass(len(prompt), matched_blocks=25, budget=budget)  # 8 blocks of room (sink 0, recent 23-24)
    lines = Passages(prompt[: probe.tail_start], SYNTHETIC, 8)
    scores = [0.0] * len(probe.candidates)
    scores[10 - 1], scores[16 - 1], scores[4 - 1] = 3.0, 2.0, 1.0  # blocks 10, 16, 4
    final = final_pass(probe, scores, budget, select_blocks=2, lines=lines)
    # 10 brings 9 (its first line starts there), 16 brings 15; the latest history fills the rest
    assert final.ranked == (10, 9, 16, 15)
    assert final.history_blocks == (0, 9, 10, 15, 16, 19, 20, 21, 22, 23, 24)
    assert final_pass(probe, scores, budget, select_blocks=2).ranked == (10, 16)
    # Without a limit the cut lines take room from the lower-ranked blocks: 8 blocks of room in all.
    full = final_pass(probe, scores, budget, lines=lines)
    assert full.ranked[:5] == (10, 9, 16, 15, 4) and len(full.ranked) == 8


def test_a_passage_spans_the_blocks_of_its_tokens_and_a_block_belongs_where_its_middle_is():
    # 4-token blocks; breaks at tokens 5, 9 and 22: passages 0..5, 6..9, 10..22, 23..31
    history = np.ones(32, dtype=np.int64)
    history[[5, 9, 22]] = BREAK
    p = Passages(history, SYNTHETIC, block_tokens=4)
    assert p.num_blocks == 8 and p.num_passages == 4
    # block 1 (tokens 4..7, middle 6): passage 6..9; blocks 2..5 (middles 10..22): passage 10..22
    assert [p.span(b) for b in range(8)] == [(0, 1), (1, 2), (2, 5), (2, 5), (2, 5), (2, 5), (5, 7), (5, 7)]
    assert p.around(4, 8) == [4, 3, 5, 2]  # nearest first, the earlier first at equal distance
    assert p.around(4, 4) == [4, 3, 5, 2]
    assert p.around(4, 3) == [4] and p.around(4, 1) == [4]  # a longer passage: the block alone
    assert p.around(0, 8) == [0, 1]
    with pytest.raises(ValueError, match="outside"):
        p.around(8, 2)


def test_a_history_without_breaks_is_one_passage_and_a_trailing_break_opens_none():
    assert Passages(np.ones(20, dtype=np.int64), SYNTHETIC, 4).num_passages == 1
    history = np.ones(16, dtype=np.int64)
    history[-1] = BREAK
    p = Passages(history, SYNTHETIC, 4)
    assert p.num_passages == 1 and p.span(3) == (0, 3)


def test_a_views_selected_blocks_bring_their_passages_whole_within_the_room():
    budget = ViewBudget(block_tokens=8, view_tokens=96, sink_tokens=8, recent_tokens=16)  # 12 blocks
    history = np.arange(1000, 1200) % 5 + 10  # 25 blocks, no break but the ones set here
    history[[8 * 6 + 3, 8 * 13 + 3, 8 * 17 + 3]] = BREAK  # passages: blocks 0..6, 6..13, 13..17, 17..24
    prompt = history.tolist() + [1, 2, 3]
    probe = first_pass(len(prompt), matched_blocks=25, budget=budget)  # 8 blocks of room (sink 0, recent 23-24)
    passages = Passages(prompt[: probe.tail_start], SYNTHETIC, 8)
    scores = [0.0] * len(probe.candidates)
    scores[15 - 1], scores[10 - 1], scores[3 - 1] = 3.0, 2.0, 1.0  # blocks 15 (13..17), 10 (6..13), 3 (0..6)
    final = final_pass(probe, scores, budget, passages=passages, passage_blocks=5)
    # 15's passage whole (13..17), then 10 alone (its passage spans 8), then 3 alone (7), then the latest
    assert final.history_blocks == (0, 3, 10, 13, 14, 15, 16, 17, 22, 23, 24)
    wide = final_pass(probe, scores, budget, passages=passages, passage_blocks=64)
    # 15's passage, then 10's passage as far as the room goes: 10, 9, 11
    assert wide.history_blocks == (0, 9, 10, 11, 13, 14, 15, 16, 17, 23, 24)
    # Without passage_blocks the passages are not used.
    assert final_pass(probe, scores, budget, passages=passages).history_blocks == \
        final_pass(probe, scores, budget).history_blocks
