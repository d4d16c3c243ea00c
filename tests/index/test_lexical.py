"""Lexical block scores (BM25 over token ids) and their fusion with the index's ranking."""
import numpy as np
import pytest

from vllm_sekv.index import lexical
from vllm_sekv.workspace.view_passes import ViewBudget, final_pass, first_pass

BT = 4


def history_with(passage_at: int, num_blocks: int = 64, seed: int = 0) -> np.ndarray:
    """Filler ids 100..109 (common words, in most blocks), a passage of rare
    ids 900..907 in blocks passage_at and passage_at + 1."""
    tokens = np.random.default_rng(seed).integers(100, 110, num_blocks * BT)
    tokens[passage_at * BT : (passage_at + 2) * BT] = np.arange(900, 908)
    return tokens


def test_the_passage_with_the_querys_rare_terms_scores_highest_and_its_neighbours_share_it():
    tokens = history_with(passage_at=20)
    scores = lexical.block_scores(tokens, [901, 905, 105, 105], BT)
    assert scores.shape == (64,)
    best = np.argsort(-scores)[: lexical.WINDOW_BLOCKS]
    assert {20, 21} <= set(best.tolist())  # both halves of the passage, among the windows holding it
    far = [b for b in range(64) if abs(b - 20) > lexical.WINDOW_BLOCKS]
    assert scores[20] > 3 * scores[far].max()  # a common term alone scores little


def test_without_a_window_only_the_blocks_holding_the_terms_score():
    tokens = history_with(passage_at=20)
    scores = lexical.block_scores(tokens, [901, 906], BT, window_blocks=0)  # 901 in block 20, 906 in 21
    assert scores[20] > 0 and scores[21] > 0
    assert not np.delete(scores, [20, 21]).any()  # neighbours share nothing of it
    windowed = lexical.block_scores(tokens, [901, 906], BT)
    assert windowed[19] > 0 and np.allclose(windowed[20] - scores[20], windowed[19])


def test_no_query_term_in_the_history_scores_zero_and_partial_blocks_are_left_out():
    tokens = history_with(passage_at=5)
    assert not lexical.block_scores(tokens, [1, 2, 3], BT).any()
    assert lexical.block_scores(tokens[: 10 * BT + 3], [901], BT).shape == (10,)
    assert lexical.block_scores(tokens[:3], [901], BT).shape == (0,)
    assert not lexical.block_scores(tokens, [], BT).any()


def test_fusion_keeps_the_index_order_without_lexical_evidence_and_promotes_with_it():
    index = np.array([0.9, 0.8, 0.7, 0.1])
    none = lexical.fuse(index, np.zeros(4), weight=1.0)
    assert np.argsort(-none).tolist() == [0, 1, 2, 3]
    promoted = lexical.fuse(index, np.array([0.0, 0.0, 0.0, 5.0]), weight=1.0)
    assert np.argmax(promoted) == 3  # the index's worst, the only lexical match
    assert np.argsort(-lexical.fuse(index, np.array([0.0, 0.0, 0.0, 5.0]), weight=0.0)).tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        lexical.fuse(index, np.zeros(3), 1.0)


def test_a_view_selected_by_fused_scores_holds_the_passage_the_index_ranked_last():
    tokens = history_with(passage_at=30)
    prompt = tokens.tolist() + [905, 105, 902]  # the new tokens ask about the passage
    budget = ViewBudget(BT, 32 * BT, 2 * BT, 2 * BT)
    probe = first_pass(len(prompt), 64, budget)
    index = np.linspace(1.0, 0.0, len(probe.candidates))  # the index prefers early blocks; 30, 31 rank low
    plain = final_pass(probe, index.tolist(), budget)
    assert 30 not in plain.history_blocks
    lex = lexical.block_scores(tokens, prompt[probe.tail_start:], BT)[list(probe.candidates)]
    fused = final_pass(probe, lexical.fuse(index, lex, 1.0).tolist(), budget)
    assert {30, 31} <= set(fused.history_blocks)


def test_a_lexical_hop_ranks_the_block_sharing_the_query_blocks_rare_terms_and_never_the_query_block():
    tokens = np.random.default_rng(1).integers(100, 110, 64 * BT)
    tokens[10 * BT:11 * BT] = [900, 901, 100, 101]  # the query block: two rare terms
    tokens[40 * BT:41 * BT] = [901, 900, 102, 103]  # the block it points to, far away
    tokens[11 * BT:12 * BT] = [100, 101, 102, 103]  # its neighbour shares common terms only
    candidates = list(range(2, 60))
    scores = lexical.hop_scores(tokens, (10 * BT, 11 * BT), candidates, BT)
    assert scores.shape == (58,) and scores[candidates.index(10)] == -np.inf
    assert candidates[int(np.argmax(scores))] == 40
    assert scores[candidates.index(40)] > 3 * scores[candidates.index(11)]


def test_a_lexical_hop_from_a_line_cut_by_the_lead_blocks_boundary_follows_the_name_past_it():
    tokens = np.random.default_rng(1).integers(100, 110, 64 * BT)
    tokens[10 * BT:12 * BT] = [104, 105, 800, 801, 902, 903, 106, 107]  # `VAR X = VAR` | `Y`, then prose
    tokens[40 * BT:41 * BT] = [902, 903, 102, 103]  # `VAR Y = 42`: Y's rare tokens
    tokens[30 * BT:31 * BT] = [800, 104, 105, 100]  # a block sharing the lead block's own rare term
    candidates = list(range(2, 60))
    alone = lexical.hop_scores(tokens, (10 * BT, 11 * BT), candidates, BT)
    lines = lexical.hop_scores(tokens, (10 * BT, 11 * BT + 2), candidates, BT)  # with the cut line's rest
    assert candidates[int(np.argmax(alone))] != 40 and candidates[int(np.argmax(lines))] == 40
    assert lines[candidates.index(11)] == -np.inf  # the lead's own line, wherever it lies


def test_question_passages_rank_the_passage_holding_the_questions_rarest_terms_first():
    history = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 5, 12])  # passages begin at 0, 4 and 10
    # 9 is in one passage, 5 in two: [8, 10) (the second piece of [4, 10)) first, then the shorter of the others
    assert lexical.question_passages(history, [5, 9, 9], [4, 10], 3, piece_tokens=4) == [(8, 10), (10, 13), (4, 8)]
    assert lexical.question_passages(history, [5, 9], [4, 10], 1, piece_tokens=4) == [(8, 10)]
    assert lexical.question_passages(history, [5, 9], [10], 3) == [(0, 10), (10, 13)]  # the first passage begins at 0
    assert lexical.question_passages(history, [99], [4, 10], 3) == []  # no range without a question term
    assert lexical.question_passages(history, [5], [4, 10], 0) == []
