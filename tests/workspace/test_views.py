"""Execution-view passes: the pure layout logic, and the planner driving them."""
from dataclasses import replace

import numpy as np
import pytest

from test_planner import BT, PAGED, Engine, prefill_and_finish
from vllm_sekv.workspace.passages import extent
from vllm_sekv.workspace.view_passes import (
    PassKind, ViewBudget, ViewPass, choose_blocks, final_pass, first_pass, hop_probe, interleave_hops,
)

BUDGET = ViewBudget(block_tokens=8, view_tokens=96, sink_tokens=8, recent_tokens=16)  # 12 blocks


def test_a_prompt_that_fits_is_one_final_pass_over_the_whole_history():
    p = first_pass(num_prompt_tokens=90, matched_blocks=11, budget=BUDGET)
    assert p.kind is PassKind.FINAL and p.samples
    assert p.history_blocks == tuple(range(11)) and p.tail_start == 88 and p.tail_tokens == 2
    assert p.history_positions() == list(range(88)) and p.tail_offset == 0


def test_a_fully_matched_prompt_still_computes_its_last_token():
    p = first_pass(num_prompt_tokens=88, matched_blocks=11, budget=BUDGET)
    assert p.tail_start == 80 and p.tail_tokens == 8


def test_anchors_of_left_out_blocks_join_the_view_as_single_tokens_in_virtual_order():
    prompt = list(range(1000, 1000 + 203))
    probe = first_pass(len(prompt), matched_blocks=25, budget=BUDGET)
    scores = [float(-i) for i in range(len(probe.candidates))]  # earliest candidates first
    # anchors, most important first: in a chosen block (3), in sink (5), beyond (100, 190: recent), left out
    anchors = [150, 3, 5, 100, 190, 77, 171]
    final = final_pass(probe, scores, BUDGET, anchors=anchors, anchor_tokens=3)
    # one block of room goes to the 3 anchor tokens: 7 chosen blocks (1..7)
    assert final.history_blocks == (0, 1, 2, 3, 4, 5, 6, 7, 23, 24)
    assert final.anchors == (77, 100, 150)  # left-out ones, at most 3, in virtual order
    positions = final.history_positions()
    assert positions == sorted(positions) and len(positions) == final.history_tokens == 10 * 8 + 3
    assert positions[64:67] == [77, 100, 150]
    tokens = final.token_ids(prompt)
    assert tokens[64:67] == [prompt[77], prompt[100], prompt[150]] and tokens[-3:] == prompt[200:203]
    assert final.num_tokens <= BUDGET.view_tokens
    assert final_pass(probe, scores, BUDGET, anchors=anchors, anchor_tokens=0).anchors == ()


def test_long_history_probes_then_selects_in_original_order():
    prompt = list(range(1000, 1000 + 203))  # 25 full blocks + 3 tokens
    probe = first_pass(len(prompt), matched_blocks=25, budget=BUDGET)
    assert probe.kind is PassKind.PROBE and not probe.samples
    assert probe.history_blocks == (0, 23, 24)  # sink 1 block, recent 2 blocks
    assert probe.candidates == tuple(range(1, 23))
    tokens = probe.token_ids(prompt)
    assert tokens[:8] == prompt[:8] and tokens[8:24] == prompt[184:200]
    assert tokens[24:27] == prompt[200:203] and len(tokens) == probe.num_tokens == 28
    assert probe.history_positions() == list(range(8)) + list(range(184, 200))
    assert probe.tail_offset == 200 - 24

    scores = [0.0] * len(probe.candidates)
    for block, score in ((5, 3.0), (17, 2.0), (2, 1.0), (9, 1.0)):
        scores[block - 1] = score
    final = final_pass(probe, scores, BUDGET)
    # room: 12 blocks - 1 sink - 2 recent - 1 tail block = 8 selected
    assert final.kind is PassKind.FINAL and len(final.history_blocks) == 11
    assert final.history_blocks[:5] == (0, 2, 5, 9, 17)  # best four, original order
    # the order they were taken in: best first, ties to the later block
    assert final.ranked == (5, 17, 9, 2, 22, 21, 20, 19)
    assert set(final.ranked) | {0, 23, 24} == set(final.history_blocks)
    assert final.history_blocks[-2:] == (23, 24)
    assert list(final.history_blocks) == sorted(final.history_blocks)
    assert final.token_ids(prompt)[-3:] == prompt[-3:] and final.num_tokens == 91
    assert final.tail_offset == 200 - 88


def test_a_hop_probe_runs_the_same_new_tokens_behind_the_view_the_scores_choose():
    prompt = list(range(1000, 1000 + 203))
    probe = first_pass(len(prompt), matched_blocks=25, budget=BUDGET)
    probe = replace(probe, rerank_extra=(4,))
    scores = [0.0] * len(probe.candidates)
    for block, score in ((5, 3.0), (17, 2.0), (2, 1.0), (9, 1.0)):
        scores[block - 1] = score
    hop = hop_probe(probe, scores, BUDGET)
    assert hop.kind is PassKind.PROBE and not hop.samples
    assert hop.history_blocks == final_pass(probe, scores, BUDGET).history_blocks
    assert hop.candidates == probe.candidates and hop.rerank_extra == (4,)  # the same blocks score again
    assert (hop.tail_start, hop.tail_tokens) == (probe.tail_start, probe.tail_tokens)
    assert hop.token_ids(prompt)[-4:-1] == prompt[200:203] and hop.num_tokens == 92  # + the sentinel
    assert not hop.recomputed and not hop.anchors


def test_interleaved_hops_take_each_hops_best_blocks_in_turn():
    first = np.array([9.0, 8.0, 7.0, 6.0, 0.0, 0.0])  # blocks 0, 1, 2, 3 best, in that order
    second = np.array([5.0, 0.0, 0.0, 0.0, 7.0, 6.0])  # 4, 5, then 0 (which the first hop has)
    order = np.argsort(-interleave_hops([first, second]), kind="stable").tolist()
    assert order == [0, 4, 1, 5, 2, 3]
    assert interleave_hops([first]) is first
    ties = interleave_hops([np.zeros(3), np.array([0.0, 1.0, 0.0])])  # ties go to the later block
    assert np.argsort(-ties, kind="stable").tolist() == [2, 1, 0]


def test_with_a_gain_a_later_hop_offers_what_it_lifts_before_what_the_first_hop_had():
    first = np.array([9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 0.0])  # 0..6 best in order, 7 last
    second = np.array([9.0, 8.0, 7.0, 0.0, 0.0, 0.0, 0.0, 6.0])  # 0, 1, 2 again, then 7 (lifted from last)
    plain = np.argsort(-interleave_hops([first, second]), kind="stable").tolist()
    assert plain[:5] == [0, 1, 2, 3, 7]  # the second hop's own best are the first hop's: 7 comes fifth
    lifted = np.argsort(-interleave_hops([first, second], gain=1.0), kind="stable").tolist()
    assert lifted[:2] == [0, 7]  # the second hop's first offer is the block it lifted most
    assert sorted(lifted) == list(range(8))
    assert interleave_hops([first], gain=1.0) is first


def test_a_long_new_part_is_ingested_down_to_a_quarter_of_the_room():
    # 4 blocks of history, 80 new tokens (10 blocks): room 9 -> at most 2 new blocks per view
    p = first_pass(num_prompt_tokens=112, matched_blocks=4, budget=BUDGET)
    assert p.kind is PassKind.INGEST and p.tail_start == 32 and p.tail_tokens == 8 * 8
    assert p.history_blocks == (0, 2, 3)
    tokens = p.token_ids(list(range(112)))
    assert tokens[-1] == 32 + 64  # the sentinel: the next prompt token, never computed
    then = first_pass(112, matched_blocks=12, budget=BUDGET)
    assert then.kind is PassKind.PROBE and then.tail_tokens == 16


def test_a_cold_prompt_starts_with_a_chunk_and_no_history():
    p = first_pass(num_prompt_tokens=500, matched_blocks=0, budget=BUDGET)
    assert p.kind is PassKind.INGEST and p.history_blocks == () and p.tail_tokens == 12 * 8


def test_budget_must_leave_room():
    with pytest.raises(ValueError, match="no room"):
        ViewBudget(8, 32, 8, 16)


# ------------------------------------------------------------- the planner


def probed_history():
    """An engine whose workspace holds 25 blocks, request "v" of those and 3
    new tokens matched against them, and the request's probe pass."""
    eng = Engine()
    prompt = list(range(1, 1 + 25 * BT))
    prefill_and_finish(eng, "a", prompt)
    full = prompt + list(range(500, 503))
    assert eng.planner.match_history("v", full, "", None) == 25
    return eng, full, first_pass(len(full), 25, BUDGET)


def test_planner_restores_a_view_with_rerope_and_saves_at_virtual_positions():
    eng = Engine()
    prompt = list(range(1, 1 + 25 * BT))
    prefill_and_finish(eng, "a", prompt)  # the workspace holds 25 blocks
    full = prompt + list(range(500, 503))
    assert eng.planner.match_history("v", full, "", None) == 25
    probe = first_pass(len(full), 25, BUDGET)
    assert eng.planner.begin_view_pass("v", probe) == 24
    eng.tokens["v"] = full
    eng.planner.set_paged_blocks("v", [200, 201], replace=True)
    eng.planner.accept_restore("v", 24)
    plan = eng.run({"v": (24, 3)})
    (restore,) = plan.restores
    assert restore.view_pass == "probe"
    records = eng.planner.requests["v"].matched
    want_rows = np.concatenate([records[b].host_slot * BT + np.arange(BT) for b in (0, 23, 24)])
    assert np.array_equal(restore.host_rows, want_rows)
    assert np.array_equal(restore.paged_slots, 200 * PAGED + np.arange(24))
    assert np.array_equal(restore.rope_deltas, np.repeat([0, (1 - 23) * BT, (2 - 24) * BT], BT))
    assert not len(plan.capture_paged_slots)  # a probe's tokens are never saved
    (score,) = plan.scores
    assert score.last and np.array_equal(score.query_positions, [24, 25, 26])
    assert len(score.candidate_slots) == 22 and score.query_virtual_offset == 200 - 24
    eng.planner.end_pass("v", eng.tokens_of)

    final = final_pass(probe, list(range(22)), BUDGET)  # the latest candidates win
    assert eng.planner.begin_view_pass("v", final) == 88
    eng.planner.set_paged_blocks("v", [300, 301, 302, 303, 304, 305, 306], replace=True)
    eng.planner.accept_restore("v", 88)
    plan = eng.run({"v": (88, 3)})
    (restore,) = plan.restores
    assert restore.view_pass == "final" and len(restore.host_rows) == 88
    # New tokens: view 88..90 -> virtual 200..202, keys rotated by +112.
    assert np.array_equal(plan.capture_rope_deltas, [112, 112, 112])
    view_slots = np.array([305 * PAGED + 8, 305 * PAGED + 9, 305 * PAGED + 10])
    assert np.array_equal(plan.capture_paged_slots, view_slots)
    # ... into the host rows of virtual block 25 (positions 200..202 -> offsets 0..2)
    assert np.array_equal(plan.capture_host_rows % BT, [0, 1, 2])

    # Decode continues at the tail; the block completes and is committed under
    # the hash of its virtual tokens: a later prompt with this history matches it.
    eng.tokens["v"] = full + [600, 601, 602, 603, 604]
    for i in range(5):
        eng.run({"v": (91 + i, 1)})
    eng.planner.finish("v", eng.tokens["v"], 208)
    eng.run({})
    assert eng.planner.match_history("w", eng.tokens["v"] + [7], "", None) == 26


def test_a_history_the_workspace_cannot_hold_is_served_from_its_end():
    from vllm_sekv.workspace.view_passes import truncated_pass

    p = truncated_pass(num_prompt_tokens=1003, matched_blocks=5, budget=BUDGET)
    assert p.kind is PassKind.FINAL and p.history_blocks == (0,)
    assert p.tail_start % 8 == 0 and p.num_tokens <= BUDGET.view_tokens
    assert p.tail_start + p.tail_tokens == 1003 and p.tail_offset == p.tail_start - 8
    none = truncated_pass(num_prompt_tokens=1003, matched_blocks=0, budget=BUDGET)
    assert none.history_blocks == () and none.num_tokens <= BUDGET.view_tokens


def test_planner_restores_anchor_tokens_at_their_view_positions():
    eng, full, probe = probed_history()
    scores = list(range(22))  # the latest candidates win: blocks 15..22
    final = final_pass(probe, scores, BUDGET, anchors=[43, 11], anchor_tokens=2)
    assert final.anchors == (11, 43) and final.history_blocks == (0, 16, 17, 18, 19, 20, 21, 22, 23, 24)
    assert eng.planner.begin_view_pass("v", final) == 10 * BT + 2
    eng.tokens["v"] = full
    eng.planner.set_paged_blocks("v", list(range(300, 307)), replace=True)
    eng.planner.accept_restore("v", 10 * BT + 2)
    plan = eng.run({"v": (10 * BT + 2, 3)})
    (restore,) = plan.restores
    records = eng.planner.requests["v"].matched
    row = lambda p: records[p // BT].host_slot * BT + p % BT  # noqa: E731
    # view: block 0 (0..7), anchor 11 (8), anchor 43 (9), blocks 16..24 (10..81)
    assert restore.host_rows[8] == row(11) and restore.host_rows[9] == row(43)
    assert restore.host_rows[10] == row(16 * BT) and restore.host_rows[-1] == row(25 * BT - 1)
    assert restore.rope_deltas[8] == 8 - 11 and restore.rope_deltas[9] == 9 - 43
    assert restore.rope_deltas[10] == 10 - 16 * BT and restore.rope_deltas[0] == 0
    # the new tokens still go to their virtual positions 200..202
    assert np.array_equal(plan.capture_rope_deltas, [200 - 82] * 3)


def test_context_blocks_bring_a_selected_blocks_neighbours_on_both_sides():
    prompt = list(range(1000, 1000 + 203))
    probe = first_pass(len(prompt), matched_blocks=25, budget=BUDGET)  # 8 blocks of room
    scores = [0.0] * len(probe.candidates)
    for block, score in ((10, 3.0), (1, 2.0), (17, 1.0)):
        scores[block - 1] = score
    final = final_pass(probe, scores, BUDGET, context_blocks=1)
    # 10 and its neighbours, then 1 (0 is the sink, not a candidate) and 2, then 17, 16 and 18
    assert final.history_blocks == (0, 1, 2, 9, 10, 11, 16, 17, 18, 23, 24)
    # Where the room ends, a block comes before its neighbours.
    tight = ViewBudget(block_tokens=8, view_tokens=64, sink_tokens=8, recent_tokens=16)  # 4 blocks of room
    probe = first_pass(len(prompt), matched_blocks=25, budget=tight)
    scores = [0.0] * len(probe.candidates)
    scores[10 - 1], scores[20 - 1] = 3.0, 2.0
    assert final_pass(probe, scores, tight, context_blocks=1).history_blocks == (0, 9, 10, 11, 20, 23, 24)


def four_scored_blocks():
    """A 203-token prompt of 25 history blocks, its probe, and scores that rank
    candidate blocks 5, 17, then 2 and 9 above the rest."""
    prompt = list(range(1000, 1000 + 203))
    probe = first_pass(len(prompt), matched_blocks=25, budget=BUDGET)
    scores = [0.0] * len(probe.candidates)
    for block, score in ((5, 3.0), (17, 2.0), (2, 1.0), (9, 1.0)):
        scores[block - 1] = score
    return prompt, probe, scores


def test_recomputed_blocks_follow_the_restored_history_and_come_before_the_new_tokens():
    prompt, probe, scores = four_scored_blocks()
    whole = final_pass(probe, scores, BUDGET)
    final = final_pass(probe, scores, BUDGET, recompute_blocks=2)  # 5 and 17, the two best
    assert final.recomputed == (5, 17)
    assert set(final.history_blocks) | {5, 17} == set(whole.history_blocks)
    assert final.history_blocks[-2:] == (23, 24) and 5 not in final.history_blocks
    assert final.history_tokens == whole.history_tokens - 2 * 8
    assert final.num_tokens == whole.num_tokens and final.tail_view_start == whole.history_tokens
    tokens = final.token_ids(prompt)
    r = final.history_tokens
    assert tokens[r : r + 16] == prompt[40:48] + prompt[136:144]  # blocks 5 and 17, after block 24
    assert tokens[r + 16 :] == prompt[200:203]
    assert final.tail_offset == 200 - (r + 16)
    # Sink and recent are never recomputed; asking for more than was chosen recomputes all chosen.
    every = final_pass(probe, scores, BUDGET, recompute_blocks=100)
    assert every.history_blocks == (0, 23, 24) and len(every.recomputed) == 8


def test_planner_restores_only_the_restored_part_and_never_saves_recomputed_history():
    eng, full, probe = probed_history()
    final = final_pass(probe, list(range(22)), BUDGET, recompute_blocks=3)  # latest win: 15..22
    assert final.recomputed == (20, 21, 22)
    assert final.history_blocks == (0, 15, 16, 17, 18, 19, 23, 24)
    restored = final.history_tokens
    assert eng.planner.begin_view_pass("v", final) == restored == 8 * BT
    eng.tokens["v"] = full
    eng.planner.set_paged_blocks("v", list(range(300, 307)), replace=True)
    eng.planner.accept_restore("v", restored)
    # A step that computes recomputed history alone saves nothing.
    plan = eng.run({"v": (restored, 2 * BT)})
    (restore,) = plan.restores
    records = eng.planner.requests["v"].matched
    assert len(restore.host_rows) == restored
    assert restore.host_rows[-1] == records[24].host_slot * BT + BT - 1
    assert not len(plan.capture_paged_slots)
    # The next computes the last recomputed block and the 3 new tokens: only
    # the new tokens are saved, at virtual 200..202 from view 88..90.
    plan = eng.run({"v": (restored + 2 * BT, BT + 3)})
    assert np.array_equal(plan.capture_rope_deltas, [200 - 88] * 3)
    assert np.array_equal(plan.capture_paged_slots, 305 * PAGED + np.array([8, 9, 10]))
    assert np.array_equal(plan.capture_host_rows % BT, [0, 1, 2])


def test_in_order_recompute_keeps_virtual_order_from_the_earliest_recomputed_block_on():
    prompt, probe, scores = four_scored_blocks()
    whole = final_pass(probe, scores, BUDGET)
    final = final_pass(probe, scores, BUDGET, recompute_blocks=2, recompute_in_order=True)
    # 5 and 17 are the best two: everything from block 5 on is recomputed, recent (23, 24) too
    assert final.history_blocks == (0, 2) and final.recomputed[0] == 5
    assert final.recomputed[-2:] == (23, 24)
    assert final.history_blocks + final.recomputed == whole.history_blocks
    assert final.token_ids(prompt) == whole.token_ids(prompt)  # the same tokens, in the same order
    assert final.num_tokens == whole.num_tokens and final.tail_offset == whole.tail_offset
    # Anchors are restored, so only those before the recomputed history keep the order.
    anchored = final_pass(probe, scores, BUDGET, anchors=[100, 10, 30], anchor_tokens=3, recompute_blocks=2,
                          recompute_in_order=True)
    assert anchored.anchors == (10, 30) and anchored.history_positions() == sorted(anchored.history_positions())
    assert max(anchored.history_positions()) < anchored.recomputed[0] * 8


def test_a_selection_limit_leaves_its_room_to_the_latest_history():
    prompt, probe, scores = four_scored_blocks()  # best: 5, 17, then 9 and 2 tied
    limited = final_pass(probe, scores, BUDGET, select_blocks=2)
    # room 8: the best 2 selected, then the 6 latest candidates they leave (16..22 without 17)
    assert limited.ranked == (5, 17)
    assert limited.history_blocks == (0, 5, 16, 17, 18, 19, 20, 21, 22, 23, 24)
    assert limited.num_tokens == final_pass(probe, scores, BUDGET).num_tokens  # the same room, filled
    assert final_pass(probe, scores, BUDGET, select_blocks=100) == final_pass(probe, scores, BUDGET)
    # In virtual order the latest history is recomputed with the rest from the earliest selected block on.
    ordered = final_pass(probe, scores, BUDGET, select_blocks=2, recompute_blocks=100, recompute_in_order=True)
    assert ordered.history_blocks == (0,) and ordered.recomputed == limited.history_blocks[1:]
    assert ordered.token_ids(prompt) == limited.token_ids(prompt)
    # A hop probe reads the whole room: the limit is the answering view's.
    assert hop_probe(probe, scores, BUDGET).history_blocks == final_pass(probe, scores, BUDGET).history_blocks


def _choose_by_extent(ranked, candidates, limit, room):
    """`choose_blocks`' general loop with single-block extents, the fast path's reference."""
    chosen = {}
    for block in ranked:
        for b in extent(block, 0):
            if len(chosen) < min(limit, room) and b in candidates and b not in chosen:
                chosen[b] = None
        if len(chosen) >= min(limit, room):
            break
    return list(chosen)


@pytest.mark.parametrize("seed", range(20))
def test_a_selection_of_single_blocks_takes_the_first_distinct_candidates(seed):
    rng = np.random.default_rng(seed)
    ranked = rng.integers(0, 60, size=80).tolist()  # repeats and blocks that are not candidates
    candidates = set(rng.choice(60, size=40, replace=False).tolist())
    limit, room = int(rng.integers(0, 30)), int(rng.integers(0, 30))
    assert choose_blocks(ranked, candidates, limit, room) == _choose_by_extent(ranked, candidates, limit, room)


@pytest.mark.parametrize("anchors", [(), (3, 41)])
def test_a_pass_takes_its_tokens_at_their_virtual_positions(anchors):
    prompt = list(range(5000, 5000 + 203))
    view = ViewPass(PassKind.PROBE, 8, (0, 1, 4, 5, 6, 9, 17), 160, 30, anchors=anchors, recomputed=(18, 19))
    positions = view.history_positions() + view.recomputed_positions() + list(range(160, 190))
    assert view.token_ids(prompt) == [prompt[p] for p in positions] + [prompt[190]]  # + the sentinel
