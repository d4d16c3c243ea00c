"""How a view coordinator builds a request's views with probe hops
(`probe_hops`: it probes again behind the view its first probe chose, then
builds the final view from both probes' rankings, limited to
`view_select_blocks` where set) and with the neighbours or
passages a request asks for (`view_context_blocks`, `view_passage_blocks`) and the
lines their boundaries cut (`view_cut_lines`), on
a real planner and vLLM request (no model: the worker's reports are given)."""
from types import SimpleNamespace

import numpy as np
import pytest

from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request
from vllm_sekv import request_params
from vllm_sekv.config import SekvConfig
from vllm_sekv.scheduler_side.view_coordinator import ViewCoordinator
from vllm_sekv.store import LRUPolicy
from vllm_sekv.workspace.catalog import BlockCatalog
from vllm_sekv.workspace.hashing import extend_block_hashes
from vllm_sekv.workspace.planner import WorkspacePlanner
from vllm_sekv.workspace.sessions import SessionTable
from vllm_sekv.workspace.passages import BreakTokens
from vllm_sekv.workspace.vocabulary import Vocabulary
from vllm_sekv.workspace.view_passes import PassKind

BT, HISTORY_BLOCKS = 16, 60
SEKV = dict(block_tokens=BT, view_tokens=12 * BT, sink_tokens=BT, recent_tokens=2 * BT)


def coordinator(vocabulary=None, edits=None, blocks=HISTORY_BLOCKS, **sekv) -> tuple[ViewCoordinator, list[int]]:
    """A coordinator whose workspace holds a history of `blocks` blocks (with
    `edits`, token position -> id, made to it), and a prompt of that history
    and 4 new tokens."""
    catalog = BlockCatalog(blocks + 8, LRUPolicy())
    planner = WorkspacePlanner(catalog, SessionTable(), BT, 16)
    views = ViewCoordinator(SekvConfig(**{**SEKV, **sekv}), planner, tenant_of=str, window_tokens=4096,
                            capacity_tokens=4096, vocabulary=vocabulary)
    history = (np.arange(blocks * BT) % 97 + 1000).tolist()
    for at, token in (edits or {}).items():
        history[at] = token
    for b, h in enumerate(extend_block_hashes([], history, BT, "")):
        catalog.commit(catalog.reserve(start_token=b * BT), h)
    return views, history + [7, 8, 9, 10]


def run_pass(views: ViewCoordinator, request: Request, prompt: list[int], scores: np.ndarray | None) -> None:
    """The engine's part of a non-sampling pass: computed, reported, taken out."""
    views.planner.set_paged_blocks(request.request_id, list(range(request.num_tokens // 16 + 2)), replace=True)
    if scores is not None:
        views.set_scores(request.request_id, scores[None].astype(np.float32))
    views.pass_done(request, lambda rid: prompt)


def step(views: ViewCoordinator, prompt: list[int], hop_scores: list[np.ndarray], **params) -> list:
    """One view step whose probes report `hop_scores` in turn; the passes run."""
    request = Request("r", prompt, SamplingParams(max_tokens=1, extra_args=params), None, block_hasher=None)
    assert views.admit(request)
    job, passes = views.jobs["r"], []
    for scores in [*hop_scores, None]:
        views.next_pass(request)
        passes.append(job.current)
        if job.current.samples:
            break
        run_pass(views, request, prompt, scores if job.current.kind is PassKind.PROBE else None)
    return passes


def test_a_second_hop_probes_behind_the_first_hops_view_and_the_view_takes_both_hops_best():
    views, prompt = coordinator(probe_hops=2)
    first = np.zeros(57)
    first[[10, 11, 12]] = [3.0, 2.0, 1.0]  # candidates are blocks 1..57: blocks 11, 12, 13
    second = np.zeros(57)
    second[[40, 41, 10]] = [3.0, 2.0, 1.0]  # blocks 41, 42, and 11 again
    probe, hop, final = step(views, prompt, [first, second])
    assert probe.kind is hop.kind is PassKind.PROBE and final.kind is PassKind.FINAL
    assert probe.history_blocks == (0, 58, 59)  # sink + recent
    assert {11, 12, 13} < set(hop.history_blocks) and hop.candidates == probe.candidates
    assert (hop.tail_start, hop.tail_tokens) == (probe.tail_start, probe.tail_tokens)
    # room for 8 chosen blocks: 11, 41, 12, 42, 13 in turn, then the latest of the rest
    chosen = set(final.history_blocks) - {0, 58, 59}
    assert len(chosen) == 8 and {11, 12, 13, 41, 42} < chosen
    # the response reports each hop's own ranking (ties: the later block first)
    probe_ranked = views.finish(SimpleNamespace(request_id="r"))["probe_ranked"]
    assert [r[:3] for r in probe_ranked] == [[11, 12, 13], [41, 42, 11]]
    assert probe_ranked[0][3:5] == [57, 56] and all(len(r) == 57 for r in probe_ranked)


def test_a_selection_limit_is_the_final_views_and_the_hop_probe_reads_the_whole_room():
    views, prompt = coordinator(probe_hops=2, view_select_blocks=2)
    first = np.zeros(57)
    first[[10, 11, 12]] = [3.0, 2.0, 1.0]  # blocks 11, 12, 13
    second = np.zeros(57)
    second[[40, 41]] = [3.0, 2.0]  # blocks 41, 42
    probe, hop, final = step(views, prompt, [first, second])
    assert {11, 12, 13} < set(hop.history_blocks)  # the whole room, 8 blocks, best first
    assert len(set(hop.history_blocks) - {0, 58, 59}) == 8
    # the final view: the 2 best of the hops in turn (11, 41), then the latest history (50..57)
    assert final.ranked == (11, 41)
    assert set(final.history_blocks) | set(final.recomputed) == {0, 11, 41, *range(52, 58), 58, 59}


def test_a_request_asks_for_its_own_hops():
    views, prompt = coordinator()
    scores = np.linspace(0, 1, 57)
    kinds = [p.kind for p in step(views, prompt, [scores, scores], probe_hops=2)]
    assert kinds == [PassKind.PROBE, PassKind.PROBE, PassKind.FINAL]
    views.jobs.clear()
    kinds = [p.kind for p in step(views, prompt, [scores])]
    assert kinds == [PassKind.PROBE, PassKind.FINAL]


def test_a_request_asks_for_its_own_hop_gain():
    views, prompt = coordinator(probe_hops=2, view_select_blocks=2)
    first = np.zeros(57)
    first[[10, 11, 12]] = [3.0, 2.0, 1.0]  # blocks 11, 12, 13
    second = np.zeros(57)
    second[[10, 11, 40]] = [3.0, 2.0, 1.0]  # 11 and 12 again, then 41 (which the first hop had low)
    assert step(views, prompt, [first, second])[-1].ranked == (11, 12)
    views.jobs.clear()
    assert step(views, prompt, [first, second], probe_hop_gain=1.0)[-1].ranked == (11, 41)


@pytest.mark.parametrize("gain", [-0.1, 1.1])
def test_a_hop_gain_outside_0_to_1_is_refused_naming_the_key(gain):
    with pytest.raises(ValueError, match="'probe_hop_gain'"):
        SekvConfig(probe_hop_gain=gain)


@pytest.mark.parametrize("hops", [0, 4])
def test_probe_hops_outside_1_to_3_are_refused_naming_the_key(hops):
    with pytest.raises(ValueError, match="'probe_hops'"):
        SekvConfig(probe_hops=hops)


def test_a_request_asks_for_its_own_context_blocks():
    views, prompt = coordinator()
    scores = np.zeros(57)
    scores[[10, 30]] = [2.0, 1.0]  # blocks 11 and 31 best
    final = step(views, prompt, [scores], view_context_blocks=2)[-1]
    # room for 8: block 11 with two neighbours on each side, then block 31 and those before it
    assert set(final.history_blocks) - {0, 58, 59} == {9, 10, 11, 12, 13, 29, 30, 31}
    views.jobs.clear()
    final = step(views, prompt, [scores])[-1]  # the server's setting: none
    assert {11, 31} <= set(final.history_blocks) and not {9, 10, 12, 13} & set(final.history_blocks)


# Token 1050 breaks passages: the history's tokens 50, 147, 244, ... (every 97th),
# so blocks 9..15 make one passage (tokens 148..244) and blocks 27..33 another.
BREAKS = BreakTokens(np.array([1050]), np.array([], dtype=np.int64), np.array([], dtype=np.int64))


def test_a_request_asks_for_its_selected_blocks_passages():
    loads = []
    views, prompt = coordinator(vocabulary=lambda: loads.append(1) or Vocabulary(BREAKS))
    scores = np.zeros(57)
    scores[[10, 30]] = [2.0, 1.0]  # blocks 11 and 31 best
    final = step(views, prompt, [scores], view_passage_blocks=8)[-1]
    # room for 8: block 11's passage whole (7 blocks), then block 31, whose passage the room cuts
    assert set(final.history_blocks) - {0, 58, 59} == {9, 10, 11, 12, 13, 14, 15, 31}
    views.jobs.clear()
    final = step(views, prompt, [scores], view_passage_blocks=6)[-1]
    # passages of 7 blocks are longer than 6: the selected blocks come alone
    assert {11, 31} <= set(final.history_blocks) and not {9, 10, 12, 13} & set(final.history_blocks)
    assert loads == [1]  # the break tokens are found once, at the first request that asks


def test_a_servers_passages_load_the_breaks_at_start_up_and_a_request_may_ask_for_neighbours_instead():
    loads = []
    views, prompt = coordinator(vocabulary=lambda: loads.append(1) or Vocabulary(BREAKS), view_passage_blocks=8)
    assert loads == [1]
    scores = np.zeros(57)
    scores[[10, 30]] = [2.0, 1.0]
    assert set(step(views, prompt, [scores])[-1].history_blocks) - {0, 58, 59} == {9, 10, 11, 12, 13, 14, 15, 31}
    views.jobs.clear()
    final = step(views, prompt, [scores], view_context_blocks=1)[-1]
    assert set(final.history_blocks) - {0, 58, 59} >= {10, 11, 12, 30, 31, 32}
    assert 9 not in final.history_blocks  # neighbours, not the passage
    with pytest.raises(ValueError, match="'view_passage_blocks'"):
        coordinator(view_passage_blocks=4)  # no tokenizer to find breaks with
    with pytest.raises(ValueError, match="'view_passage_blocks'"):
        SekvConfig(view_passage_blocks=4, view_context_blocks=1)
    with pytest.raises(ValueError, match="'view_passage_blocks'"):
        SekvConfig(view_passage_blocks=65)


def test_a_tokenizer_that_cannot_load_leaves_views_without_passages(caplog):
    def broken():
        raise OSError("no tokenizer files")

    views, prompt = coordinator(vocabulary=broken)
    scores = np.zeros(57)
    scores[[10, 30]] = [2.0, 1.0]
    final = step(views, prompt, [scores], view_passage_blocks=8)[-1]
    assert {11, 31} <= set(final.history_blocks) and 9 not in final.history_blocks
    assert "no passage or line breaks (no tokenizer files)" in caplog.text


# Lines end at tokens 1001 and 1093 (history positions 1, 93, 98, 190, 195, ...): the line of
# tokens 191..195 crosses the boundary of blocks 11 (176..191) and 12 (192..207).
LINES = BreakTokens(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64),
                    newlines=np.array([1001, 1093]))


def test_a_request_asks_for_the_lines_its_selected_blocks_cut():
    loads = []
    views, prompt = coordinator(vocabulary=lambda: loads.append(1) or Vocabulary(LINES))
    assert loads == []  # found at the first request that asks
    scores = np.zeros(57)
    scores[[11, 30]] = [2.0, 1.0]  # blocks 12 and 31 best
    final = step(views, prompt, [scores], view_select_blocks=2, view_cut_lines=True)[-1]
    # block 12's first line starts in block 11: it comes along, not counted against the limit of 2
    assert final.ranked == (12, 11, 31)
    assert set(final.history_blocks) == {0, 11, 12, 31, *range(53, 58), 58, 59}
    views.jobs.clear()
    assert step(views, prompt, [scores], view_select_blocks=2)[-1].ranked == (12, 31)  # the server's: off
    assert loads == [1]


def test_a_servers_cut_lines_load_the_breaks_at_start_up_and_a_request_may_turn_them_off():
    loads = []
    views, prompt = coordinator(vocabulary=lambda: loads.append(1) or Vocabulary(LINES), view_cut_lines="on")
    assert loads == [1]
    scores = np.zeros(57)
    scores[[11, 30]] = [2.0, 1.0]
    assert step(views, prompt, [scores], view_select_blocks=2)[-1].ranked == (12, 11, 31)
    views.jobs.clear()
    assert step(views, prompt, [scores], view_select_blocks=2, view_cut_lines=False)[-1].ranked == (12, 31)
    with pytest.raises(ValueError, match="'view_cut_lines'"):
        coordinator(view_cut_lines="on")  # no tokenizer to find breaks with
    with pytest.raises(ValueError, match="'view_cut_lines'"):
        SekvConfig.from_sources({"view_cut_lines": "yes"})


# Block 11: a line naming another (two rare tokens, then words found nowhere else), which block 33 holds far
# from it; block 40 shares one of the two.
NAMES = {11 * BT + i: 60000 + i for i in range(BT)} | {11 * BT: 50001, 11 * BT + 1: 50002, 33 * BT + 5: 50002,
                                                         33 * BT + 6: 50001, 40 * BT: 50001}


def test_a_lexical_hop_follows_the_first_probes_best_block_to_the_block_sharing_its_rare_tokens():
    views, prompt = coordinator(edits=NAMES, probe_lexical_hop="on", view_select_blocks=2)
    scores = np.zeros(57)
    scores[[10, 20, 21]] = [3.0, 2.0, 1.0]  # the probe: blocks 11, 21, 22 (candidates are blocks 1..57)
    probe, final = step(views, prompt, [scores])
    # the probe's best, then the lexical hop's best (33, not 11 itself), then the latest history
    assert final.ranked == (11, 33)
    report = views.finish(SimpleNamespace(request_id="r"))
    assert report["lexical_hop_ranked"][:2] == [33, 40] and 11 not in report["lexical_hop_ranked"][:-1]
    assert "probe_ranked" not in report  # one probe


def test_without_the_lexical_hop_the_view_takes_the_probes_ranking_alone():
    views, prompt = coordinator(edits=NAMES, view_select_blocks=2)
    scores = np.zeros(57)
    scores[[10, 20, 21]] = [3.0, 2.0, 1.0]
    probe, final = step(views, prompt, [scores])
    assert final.ranked == (11, 21)
    assert "lexical_hop_ranked" not in views.finish(SimpleNamespace(request_id="r"))


# In a 600-block history (a template stands out of a long one only), blocks 11, 21, 22 and 33 hold one
# template (two tokens found nowhere else); block 11 (the first probe's best) and block 33 share a name,
# blocks 21 and 22 have names of their own: look-alikes.
LONG = 600
TEMPLATE = {11 * BT + 2: 50010, 11 * BT + 3: 50011, 21 * BT + 2: 50010, 21 * BT + 3: 50011,
            22 * BT + 2: 50010, 22 * BT + 3: 50011, 33 * BT + 2: 50010, 33 * BT + 3: 50011,
            11 * BT + 4: 50001, 33 * BT + 4: 50001, 21 * BT + 4: 50003, 22 * BT + 4: 50004}


def template_scores() -> np.ndarray:
    scores = np.zeros(LONG - 3)
    scores[[10, 20, 21, 32]] = [4.0, 3.0, 2.0, 1.0]  # blocks 11, 21, 22, 33 (candidates are blocks 1..597)
    return scores


def test_dropping_lookalikes_leaves_the_templates_other_instances_out():
    views, prompt = coordinator(edits=TEMPLATE, blocks=LONG, view_lookalikes="drop", view_select_blocks=2)
    probe, final = step(views, prompt, [template_scores()])
    assert final.ranked == (11, 33)  # 21 and 22 outrank 33, and are left out
    assert not {21, 22} & set(final.history_blocks)
    assert views.finish(SimpleNamespace(request_id="r"))["lookalike_blocks"] == 2


def test_lookalikes_compare_words_a_block_spelling_the_asked_name_with_another_token_is_kept():
    # block 33 writes the name 50001 as 50021, a token of the same word (`_MIN` beside `MIN`)
    spelt = TEMPLATE | {33 * BT + 4: 50021}
    words = np.arange(60000)
    words[50021] = 50001
    views, prompt = coordinator(edits=spelt, blocks=LONG, view_lookalikes="drop", view_select_blocks=2)
    assert 33 not in step(views, prompt, [template_scores()])[-1].ranked  # by token ids: a look-alike
    loads = []
    views, prompt = coordinator(vocabulary=lambda: loads.append(1) or Vocabulary(LINES, words), edits=spelt,
                                blocks=LONG, view_lookalikes="drop", view_select_blocks=2)
    assert loads == [1]  # read at start-up: the server drops look-alikes
    assert step(views, prompt, [template_scores()])[-1].ranked == (11, 33)


def test_lookalikes_judge_the_questions_turn_not_the_earlier_answer_the_new_tokens_begin_with():
    # the new tokens: an earlier answer naming block 21's name (50003), a turn token, the question's turn
    turn, new = 60000, [50003, 60000, *[7] * 32]
    args = dict(edits=TEMPLATE, blocks=LONG, view_lookalikes="drop", view_select_blocks=2, view_tokens=32 * BT)
    views, prompt = coordinator(**args)  # room for the new tokens without ingesting them first
    assert step(views, prompt[:-4] + new, [template_scores()])[-1].ranked == (11, 21)  # turns unknown: asked
    views, prompt = coordinator(vocabulary=lambda: Vocabulary(LINES, turns=np.array([turn])), **args)
    assert step(views, prompt[:-4] + new, [template_scores()])[-1].ranked == (11, 33)


def test_the_lead_block_is_the_one_the_questions_end_names_not_the_first_probes_best():
    # a third look-alike, block 25: the template has three instances about another name than the asked one
    edits = TEMPLATE | {25 * BT + 2: 50010, 25 * BT + 3: 50011, 25 * BT + 4: 50005}
    views, prompt = coordinator(edits=edits, blocks=LONG, view_lookalikes="drop", view_select_blocks=2)
    scores = np.zeros(LONG - 3)
    scores[[20, 10, 21, 24, 32]] = [5.0, 4.0, 3.0, 2.0, 1.0]  # block 21 (another name) first, then 11
    probe, final = step(views, prompt[:-4] + [7, 8, 50001, 50001], [scores])  # the question names 50001
    assert final.ranked == (11, 33)  # 11 leads: 21, 22 and 25 are its look-alikes


def test_the_lead_lines_run_past_the_lead_blocks_boundary_to_the_name_its_value_line_shares():
    # Block 11's last token starts a line (191..195) whose rest names 50001 in block 12; block 33 holds 50001
    named = {k: v for k, v in TEMPLATE.items() if k != 11 * BT + 4} | {12 * BT + 1: 50001}
    views, prompt = coordinator(vocabulary=lambda: Vocabulary(LINES), edits=named, blocks=LONG, view_lookalikes="drop",
                                view_select_blocks=2)
    assert step(views, prompt, [template_scores()])[-1].ranked == (11, 33)
    views, prompt = coordinator(edits=named, blocks=LONG, view_lookalikes="drop", view_select_blocks=2)
    assert 33 not in step(views, prompt, [template_scores()])[-1].ranked  # no line breaks: block 11 alone


def test_lookalikes_are_kept_by_default_and_a_request_may_drop_them():
    views, prompt = coordinator(edits=TEMPLATE, blocks=LONG, view_select_blocks=2)
    assert step(views, prompt, [template_scores()])[-1].ranked == (11, 21)
    assert "lookalike_blocks" not in views.finish(SimpleNamespace(request_id="r"))
    assert step(views, prompt, [template_scores()], view_lookalikes="drop")[-1].ranked == (11, 33)
    with pytest.raises(ValueError, match="'view_lookalikes'"):
        SekvConfig.from_sources({"view_lookalikes": "on"})
    with pytest.raises(request_params.RequestParamError, match="kv_transfer_params.view_lookalikes"):
        request_params.parse({"view_lookalikes": True})


def test_a_view_takes_the_passage_text_retrieval_ranks_best_for_the_question_first():
    # block 40 holds the question's two rare words; the probe ranks blocks 11 and 12 best
    edits = {40 * BT + 3: 50001, 40 * BT + 4: 50002, 20 * BT + 3: 50002}
    loads = []
    views, prompt = coordinator(vocabulary=lambda: loads.append(1) or Vocabulary(BREAKS, np.arange(60000),
                                                                                 np.array([7])),
                                edits=edits, view_question_passages=1, view_select_blocks=2)
    assert loads == [1]  # read at start-up: the server adds passages
    prompt = prompt[:-4] + [50001, 7, 50002, 50001]  # the question: the new tokens after the turn token 7
    scores = np.zeros(57)
    scores[[10, 11]] = [2.0, 1.0]  # candidates are blocks 1..57: blocks 11, 12
    final = step(views, prompt, [scores])[-1]
    reported = views.finish(SimpleNamespace(request_id="r"))["question_blocks"]
    # the passage: the tokens after the break token 1050 (at every 97th token, from token 50) up to the next
    end = 40 * BT + 3 - (40 * BT + 3 - 50) % 97
    assert reported == list(range((end + 1) // BT, (end + 97) // BT + 1))
    assert len(reported) == 7 and final.ranked == (*reported, 11)  # room for 8: the passage, then the probe's best
    views, prompt = coordinator(vocabulary=lambda: Vocabulary(BREAKS, np.arange(60000), np.array([7])),
                                edits=edits, view_select_blocks=2)
    final = step(views, prompt[:-4] + [50001, 7, 50002, 50001], [scores])[-1]
    assert final.ranked == (11, 12) and "question_blocks" not in views.finish(SimpleNamespace(request_id="r"))
