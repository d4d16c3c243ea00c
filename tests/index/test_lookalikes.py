"""Look-alikes (`index.lookalikes`): a template's other instances are left
out, the asked chain and prose are not; the lead block is the one the
question's own rare tokens name."""
import numpy as np

from vllm_sekv.index.lookalikes import LEAD_CANDIDATES, QUESTION_TOKENS, lead_block, lookalike_mask, question_of

BT = 8
VAR, EQ = 7, 8  # the template's tokens: in the planted lines only
PROSE = np.arange(1000, 1040)  # words every block holds some of
rng = np.random.default_rng(0)


def history(lines: dict[int, list[int]], num_blocks: int = 1000) -> np.ndarray:
    """Prose blocks; block b starts with `lines[b]` where given."""
    tokens = rng.choice(PROSE, size=(num_blocks, BT))
    for b, line in lines.items():
        tokens[b, : len(line)] = line
    return tokens.reshape(-1)


def name(*ids: int) -> list[int]:  # a name: rare subword pieces
    return list(ids)


# The asked chain: "VAR AB = VAR CD" (found first) and "VAR CD = 42"; two
# other chains in the same template; a block naming the asked chain's end.
A, C, E, G, K = name(101, 102), name(103, 104), name(105, 106), name(107, 108), name(109, 110)
LINES = {
    50: [VAR, *A, EQ, VAR, *C],  # the lead block
    90: [VAR, *C, EQ, 42],  # the chain's value line
    120: [VAR, *E, EQ, VAR, *G],  # look-alikes
    200: [VAR, *G, EQ, 77],
    260: [VAR, *K, EQ, 5],
}
LEAD = (50 * BT, 51 * BT)  # the lead block's tokens: its lines are whole


def test_other_instances_of_the_template_are_lookalikes():
    h = history(LINES)
    candidates = list(range(2, 990))
    ranked = [50, 120, 200, 90, 260, 3, 4, 5]
    order = [candidates.index(b) for b in ranked] + [i for i, b in enumerate(candidates) if b not in ranked]
    mask = lookalike_mask(h, candidates, order, lead=LEAD, query=[2000, VAR, *A], block_tokens=BT)
    dropped = {b for b, m in zip(candidates, mask) if m}
    assert dropped == {120, 200, 260}  # not the lead block, not the value line (it shares C), no prose


def test_a_name_past_the_lead_blocks_boundary_keeps_its_value_line_with_the_lead_lines():
    # "VAR AB = VAR" | "CD": the line is cut after VAR, so only the rest of it names the value line's CD
    lines = {**LINES, 50: [*PROSE[:4], VAR, *A, EQ], 51: [VAR, *C, *PROSE[5:10]]}
    h = history(lines)
    candidates = list(range(2, 990))
    ranked = [50, 120, 200, 90, 260, 3, 4, 5]
    order = [candidates.index(b) for b in ranked] + [i for i, b in enumerate(candidates) if b not in ranked]
    alone = lookalike_mask(h, candidates, order, lead=LEAD, query=[VAR, *A], block_tokens=BT)
    whole = lookalike_mask(h, candidates, order, lead=(50 * BT, 51 * BT + 3), query=[VAR, *A], block_tokens=BT)
    assert 90 in {b for b, m in zip(candidates, alone) if m}  # the block alone drops the asked value
    assert {b for b, m in zip(candidates, whole) if m} == {120, 200, 260}


def test_a_block_the_question_names_is_kept():
    h = history(LINES)
    candidates = list(range(2, 990))
    ranked = [50, 120, 200, 90, 260]
    order = [candidates.index(b) for b in ranked] + [i for i, b in enumerate(candidates) if b not in ranked]
    mask = lookalike_mask(h, candidates, order, lead=LEAD, query=[VAR, *K], block_tokens=BT)
    assert {b for b, m in zip(candidates, mask) if m} == {120, 200}  # K's line is asked about too


def test_without_a_template_nothing_is_a_lookalike():
    h = history({50: [301, 302], 51: [303], 90: [304]})  # a paragraph's rare words, no repeated template
    candidates = list(range(2, 990))
    order = [candidates.index(b) for b in (50, 51, 90, 3, 4)]
    order += [i for i in range(len(candidates)) if i not in order]
    mask = lookalike_mask(h, candidates, order, lead=LEAD, query=[301, 2000], block_tokens=BT)
    assert not mask.any()


def test_in_a_short_history_no_template_stands_out():
    h = history(LINES, num_blocks=300)  # the template's share of the top can be at most 300 / 32 times its own
    candidates = list(range(2, 290))
    order = [candidates.index(b) for b in (50, 120, 200, 90, 260)]
    order += [i for i in range(len(candidates)) if i not in order]
    assert not lookalike_mask(h, candidates, order, lead=LEAD, query=[VAR, *A], block_tokens=BT).any()


def test_inputs_are_left_alone_and_empty_inputs_give_empty_masks():
    h = history(LINES)
    before = h.copy()
    candidates = list(range(2, 990))
    lookalike_mask(h, candidates, list(range(len(candidates))), LEAD, [VAR], BT)
    assert np.array_equal(h, before)
    assert lookalike_mask(h, [], [], LEAD, [VAR], BT).shape == (0,)
    assert lookalike_mask(h[:3], [0], [0], (0, BT), [VAR], BT).tolist() == [False]


def test_the_lead_block_is_the_one_the_questions_own_end_names():
    h = history(LINES)
    # The new tokens begin with an earlier exchange naming E (block 120's chain), and end with the question,
    # which names A (block 50's) twice; the first probe ranked block 120 best.
    query = [VAR, *E, 2000] + [3000 + i for i in range(40)] + [VAR, *A, 2001, VAR, *A]
    assert lead_block(h, [120, 3, 50], query, BT) == 50
    assert lead_block(h, [120, 3, 50], query[:3], BT) == 120  # E is the question's, as far as it goes
    assert lead_block(h, [120, 3], [2000, 2001], BT) == 120  # no rare token: the first probe's best
    assert lead_block(h, [3, 4, 5, 6, 50][: LEAD_CANDIDATES + 1], [VAR, *A], BT) == 3  # 50 is past the candidates


def test_a_name_sharing_a_piece_with_the_asked_one_is_a_lookalike():
    # "VAR AB = 42" asked by its name AB; "VAR QB = 77" shares the piece B (another service of the same kind)
    a, q = name(101, 102), name(111, 102)
    lines = {50: [VAR, *a, EQ, 42], 120: [VAR, *q, EQ, 77], 200: [VAR, *E, EQ, 5], 230: [VAR, *G, EQ, 9],
             260: [VAR, *a, 2000]}
    h = history(lines)
    candidates = list(range(2, 990))
    order = [candidates.index(b) for b in (50, 120, 200, 230)]
    order += [i for i in range(len(candidates)) if i not in order and candidates[i] != 260]
    order.insert(40, candidates.index(260))  # past the top: the piece B is in 2 of its blocks, not a template token
    mask = lookalike_mask(h, candidates, order, lead=LEAD, query=[2001, VAR, *a], block_tokens=BT)
    assert {b for b, m in zip(candidates, mask) if m} == {120, 200, 230}  # 260 names all of AB: kept


def test_the_asked_names_pieces_gathered_with_it_are_not_a_template():
    # A constant FOO_MIN: its uses (F _ M) rank best, its definition splits the name differently (F M'), and
    # another constant BAR_MIN's uses (G _ M) share the piece M. F comes only with the asked name: not template.
    F, M, M2, G_, US = 121, 122, 123, 124, int(PROSE[0])
    uses, others = (50, 60, 70, 80), (100, 110, 130)
    lines = {**{b: [F, US, M, EQ] for b in uses}, 90: [F, M2, EQ, 5], **{b: [G_, US, M] for b in others}}
    h = history(lines)
    candidates = list(range(2, 990))
    order = [candidates.index(b) for b in (*uses, 90, *others)]
    order += [i for i in range(len(candidates)) if i not in order]
    mask = lookalike_mask(h, candidates, order, lead=LEAD, query=[2000, F, US, M], block_tokens=BT)
    assert {b for b, m in zip(candidates, mask) if m} == set(others)  # the definition and the uses are kept


def test_a_block_holding_only_a_cut_lines_end_is_judged_by_its_line():
    # a look-alike "VAR EF = 77" cut before its value: block 121 holds only the value, no template token
    lines = {**LINES, 120: [*PROSE[:4], VAR, *E, EQ], 121: [77, *PROSE[:7]]}
    h = history(lines)
    candidates = list(range(2, 990))
    order = [candidates.index(b) for b in (50, 120, 121, 90, 200, 260)]
    order += [i for i in range(len(candidates)) if i not in order]
    args = (h, candidates, order, LEAD, [2000, VAR, *A], BT)
    alone = {b for b, m in zip(candidates, lookalike_mask(*args)) if m}
    spans = np.array([[b * BT, b * BT + BT] for b in candidates])
    spans[candidates.index(121), 0] = 120 * BT + 5  # the line through block 121's first token starts in 120
    lines_of = {b for b, m in zip(candidates, lookalike_mask(*args, spans=spans)) if m}
    assert 121 not in alone and 121 in lines_of
    assert lines_of - {121} == alone



def test_tokens_compare_by_word_and_an_id_past_the_vocabulary_is_its_own():
    # the constant F _ M of the test above; its definition writes F as F2, a token of the same word
    F, F2, M, G_, US, SET = 121, 125, 122, 124, int(PROSE[0]), int(PROSE[1])  # `_`, `=`: common tokens
    uses, others = (50, 60, 70, 80), (100, 110, 130)
    lines = {**{b: [F, US, M, SET] for b in uses}, 90: [F2, M, SET, 5], **{b: [G_, US, M] for b in others},
             300: [5000, *PROSE[:3]]}  # 5000: an id past the tokenizer's vocabulary
    h = history(lines)
    words = np.arange(1100)
    words[F2] = F
    candidates = list(range(2, 990))
    order = [candidates.index(b) for b in (*uses, 90, *others)]
    order += [i for i in range(len(candidates)) if i not in order]
    args = (h, candidates, order, LEAD, [2000, F, US, M], BT)
    by_id = {b for b, m in zip(candidates, lookalike_mask(*args)) if m}
    by_word = {b for b, m in zip(candidates, lookalike_mask(*args, words=words)) if m}
    assert by_id == {90, *others}  # by ids the definition lacks F and holds the template token M
    assert by_word == set(others)


TURN = 900  # a turn token (the tokenizer's special id starting or ending a chat turn)


def test_the_question_is_the_turn_holding_the_querys_end():
    asked = [3000 + i for i in range(QUESTION_TOKENS + 8)]  # longer than QUESTION_TOKENS
    query = [1, 2, TURN, 4, TURN, *asked, TURN, 5, 6]  # the previous exchange, the question, the answer's start
    assert question_of(query, np.array([TURN])).tolist() == [*asked, TURN, 5, 6]
    assert question_of(query, None).tolist() == query  # turns unknown: the whole query
    assert question_of(asked, np.array([TURN])).tolist() == asked  # no turn token before its end


def test_a_name_the_previous_exchange_gives_is_not_the_questions():
    # the query begins with an earlier answer naming the chain E -> G it followed; then the question about A
    h = history(LINES)
    candidates = list(range(2, 990))
    ranked = [50, 120, 200, 90, 260, 3, 4, 5]
    order = [candidates.index(b) for b in ranked] + [i for i, b in enumerate(candidates) if b not in ranked]
    query = [VAR, *E, 2001, TURN, *PROSE[: QUESTION_TOKENS], VAR, *A]
    whole = lookalike_mask(h, candidates, order, lead=LEAD, query=query, block_tokens=BT)
    turn = lookalike_mask(h, candidates, order, lead=LEAD, query=query, block_tokens=BT, turns=np.array([TURN]))
    assert {b for b, m in zip(candidates, whole) if m} == {200, 260}  # E keeps its chain's first line
    assert {b for b, m in zip(candidates, turn) if m} == {120, 200, 260}
