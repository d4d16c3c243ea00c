"""Execution views: which history blocks a step sees, and where.

Pure logic, no vLLM or torch. A request whose prompt is longer than its view
budget is served in *passes*; each pass is an ordinary vLLM request whose
token sequence is

    history (restored from the workspace, in virtual order): whole blocks
        `history_blocks` and single anchor tokens `anchors`
    + recomputed history (FINAL only): whole blocks `recomputed`, in virtual
        order, computed afresh inside the view instead of restored
    + tail (prompt tokens computed in this pass)
    + one sentinel token (only in passes that must not sample)

at positions 0..len-1. The history token at view position `i` is the
workspace token at virtual position `history_positions()[i]` (its position in
the full history), so its key is re-RoPE'd by `i - virtual`; the tail's tokens
are saved at their virtual positions, `virtual = view + tail_offset`.
Recomputed history is already in the workspace and is not saved again.

Passes, in order:

* `INGEST`: the part of the prompt not yet in the workspace would leave too
  little room for selected history (it takes more than a quarter of what
  sink + recent leave): compute the next chunk of whole blocks behind sink + recent
  history (a sliding window), save it, match again.
* `PROBE`: compute the new tokens behind sink + recent history; their queries
  score the candidate blocks (every other history block).
* `PROBE` again, `probe_hops` - 1 times: the new tokens computed behind
  the view the probes so far chose (`hop_probe`), so their queries have
  read that evidence and can find what it points to; the same candidates.
* `FINAL`: sink + the highest-scoring candidates (original order) + recent +
  the new tokens; this pass samples, and its new and generated tokens are
  saved at their virtual positions. SeKV anchors (high-surprisal tokens) of
  blocks the view leaves out come along as single tokens, in virtual order,
  within a token budget of their own. The best-scoring selected blocks can
  be recomputed rather than restored (`recompute_blocks`): restored KV was
  computed inside the whole long history and carries what the model read
  there; recomputed KV sees only the view, and sits next to the new tokens.
  A view may take fewer candidates than its room holds (`select_blocks`):
  the latest history fills the rest, as it fills a prompt cut to its end.
  The limit is the final view's: the probes before it read the whole room.

The sentinel makes a pass end one token short of its sequence, so vLLM treats
it as an unfinished chunked prefill and never samples from it: nothing of an
`INGEST` or `PROBE` pass reaches the client.
"""
from __future__ import annotations

import enum
import itertools
import operator
from dataclasses import dataclass, replace
from typing import Container, Iterable, Sequence

import numpy as np

from vllm_sekv.workspace.passages import Passages, extent


class PassKind(enum.Enum):
    INGEST = "ingest"
    PROBE = "probe"
    FINAL = "final"


@dataclass(frozen=True)
class ViewBudget:
    """Token budget of one request's views (all in tokens, block-aligned)."""

    block_tokens: int
    view_tokens: int  # most tokens a pass may hold before generation
    sink_tokens: int
    recent_tokens: int

    def __post_init__(self) -> None:
        bt = self.block_tokens
        if self.view_tokens < self.sink_tokens + self.recent_tokens + 2 * bt:
            raise ValueError(
                f"a view of {self.view_tokens} tokens has no room next to "
                f"{self.sink_tokens} sink and {self.recent_tokens} recent tokens"
            )

    @property
    def blocks(self) -> int:
        return self.view_tokens // self.block_tokens


@dataclass(frozen=True)
class ViewPass:
    kind: PassKind
    block_tokens: int
    history_blocks: tuple[int, ...]  # virtual block index of each view block, in view order
    tail_start: int  # virtual position of the tail's first token (a block boundary)
    tail_tokens: int  # prompt tokens computed in this pass
    candidates: tuple[int, ...] = ()  # PROBE: the blocks its queries score
    # PROBE: indices into `candidates` that a token-level re-rank scores
    # beside the index's best (`lexical_candidates`).
    rerank_extra: tuple[int, ...] = ()
    anchors: tuple[int, ...] = ()  # virtual positions of single anchor tokens, outside history_blocks
    # FINAL: budget tokens kept free for device KV that is not a token of the
    # pass (SeKV coarse summaries, one token's KV each).
    reserved_tokens: int = 0
    # FINAL: virtual blocks computed in the pass after the restored history,
    # before the tail (virtual order; disjoint from history_blocks).
    recomputed: tuple[int, ...] = ()
    # FINAL: the selected blocks (sink, recent and the latest history that
    # fills what `select_blocks` leaves aside) in the order the selection
    # took them, best first, each block's neighbours or passage after it.
    # What a response reports; the pass does not depend on it.
    ranked: tuple[int, ...] = ()

    @property
    def history_tokens(self) -> int:
        """Tokens restored from the workspace (view positions 0 .. history_tokens - 1)."""
        return len(self.history_blocks) * self.block_tokens + len(self.anchors)

    @property
    def tail_view_start(self) -> int:
        """View position of the tail's first token (after any recomputed history)."""
        return self.history_tokens + len(self.recomputed) * self.block_tokens

    def recomputed_positions(self) -> list[int]:
        """Virtual position of each recomputed history token, in view order."""
        bt = self.block_tokens
        return [b * bt + i for b in self.recomputed for i in range(bt)]

    def history_positions(self) -> list[int]:
        """Virtual position of each history token, in view order (= virtual order)."""
        bt = self.block_tokens
        blocks = np.asarray(self.history_blocks, dtype=np.int64)
        out = (blocks[:, None] * bt + np.arange(bt, dtype=np.int64)).reshape(-1)
        if self.anchors:
            out = np.sort(np.concatenate([out, np.asarray(self.anchors, dtype=np.int64)]))
        return out.tolist()

    @property
    def samples(self) -> bool:
        return self.kind is PassKind.FINAL

    @property
    def num_tokens(self) -> int:
        """Length of the pass's token sequence, sentinel included."""
        return self.tail_view_start + self.tail_tokens + (0 if self.samples else 1)

    @property
    def tail_offset(self) -> int:
        """`virtual - view` for every tail (and generated) token."""
        return self.tail_start - self.tail_view_start

    def token_ids(self, prompt: Sequence[int]) -> list[int]:
        """The pass's token sequence (`num_tokens` long) taken from `prompt`,
        the request's whole prompt in virtual order."""
        if self.anchors:
            positions = self.history_positions() + self.recomputed_positions()
            out = list(operator.itemgetter(*positions)(prompt)) if len(positions) > 1 else [prompt[positions[0]]]
        else:  # whole blocks: a slice each (a 64K view of a 512K prompt in about a millisecond)
            bt, out = self.block_tokens, []
            for b in (*self.history_blocks, *self.recomputed):
                out.extend(prompt[b * bt : (b + 1) * bt])
        end = self.tail_start + self.tail_tokens
        out.extend(prompt[self.tail_start : end])
        if not self.samples:
            # Never computed; any token would do. The next prompt token keeps
            # the sequence a plain prefix of the real one where it can.
            out.append(prompt[end] if end < len(prompt) else prompt[-1])
        return out


def _sink_and_recent(history: int, budget: ViewBudget) -> tuple[list[int], list[int]]:
    bt = budget.block_tokens
    sink = list(range(min(budget.sink_tokens // bt, history)))
    recent = list(range(max(len(sink), history - budget.recent_tokens // bt), history))
    return sink, recent


def first_pass(num_prompt_tokens: int, matched_blocks: int, budget: ViewBudget) -> ViewPass:
    """The next pass of a prompt whose first `matched_blocks` blocks are in
    the workspace (contiguous from block 0, all restorable).

    Of the room a view leaves next to sink + recent, the new tokens may take
    at most a quarter: the rest is for selected history. Longer new parts are
    ingested first, chunk by chunk, behind sink + recent, down to that quarter
    (the last new tokens, e.g. the question, then see the selected history).
    """
    bt = budget.block_tokens
    # vLLM computes at least one prompt token: never treat the whole prompt as history.
    history = min(matched_blocks, (num_prompt_tokens - 1) // bt)
    tail = num_prompt_tokens - history * bt
    tail_blocks = -(-tail // bt)
    if history + tail_blocks <= budget.blocks:
        return ViewPass(PassKind.FINAL, bt, tuple(range(history)), history * bt, tail)
    sink, recent = _sink_and_recent(history, budget)
    room = budget.blocks - len(sink) - len(recent)
    if tail_blocks > room // 4:
        chunk = min(room, tail_blocks - room // 4)
        return ViewPass(PassKind.INGEST, bt, tuple(sink + recent), history * bt, chunk * bt)
    candidates = tuple(range(len(sink), history - len(recent)))
    return ViewPass(PassKind.PROBE, bt, tuple(sink + recent), history * bt, tail, candidates)


def truncated_pass(num_prompt_tokens: int, matched_blocks: int, budget: ViewBudget) -> ViewPass:
    """The fallback when the workspace cannot hold the history (it did not
    keep what was ingested): the sink blocks it holds + the prompt's last
    tokens that fit the budget, computed as the tail. Lossy, but it serves."""
    bt = budget.block_tokens
    sink = list(range(min(budget.sink_tokens // bt, matched_blocks, (num_prompt_tokens - 1) // bt)))
    room = budget.view_tokens - len(sink) * bt
    tail_start = max(len(sink) * bt, -(-(num_prompt_tokens - room) // bt) * bt)
    return ViewPass(PassKind.FINAL, bt, tuple(sink), tail_start, num_prompt_tokens - tail_start)


def hop_probe(probe: ViewPass, scores: Sequence[float], budget: ViewBudget, context_blocks: int = 0,
              passages: Passages | None = None, passage_blocks: int = 0) -> ViewPass:
    """The next probe after `probe`: its new tokens and candidates behind
    the view `scores` choose (`final_pass`'s blocks, every one restored).
    A probe reads the whole room whatever limit the final view's selection
    has: nothing is answered from it, and every block it reads is one its
    new tokens can find the next evidence from."""
    view = final_pass(probe, scores, budget, context_blocks, passages=passages, passage_blocks=passage_blocks)
    return replace(view, kind=PassKind.PROBE, candidates=probe.candidates, rerank_extra=probe.rerank_extra, ranked=())


def rank_order(scores: Sequence[float]) -> np.ndarray:
    """The indices of `scores`, best first; ties go to the later index (the
    more recent block), as every ranking of candidates here breaks them."""
    return np.lexsort((-np.arange(len(scores)), -np.asarray(scores, dtype=np.float64)))


def rank_places(scores: Sequence[float]) -> np.ndarray:
    """Each candidate's place in `rank_order(scores)` (0: the best)."""
    place = np.empty(len(scores))
    place[rank_order(scores)] = np.arange(len(scores))
    return place


def interleave_hops(hops: Sequence[np.ndarray], gain: float = 0.0) -> np.ndarray:
    """One score per candidate from each probe hop's scores (`hops[h][i]`
    rates candidate `i`): ranking by it takes the hops' best blocks in turn
    (hop 0's best, hop 1's best, hop 0's second, ...; a block at its best
    place over the hops). Ties within a hop go to the later block, as in
    `final_pass`. One hop: its own scores.

    `gain` > 0: a later hop ranks a candidate by how far it lifts it over
    the hops before it, `gain * log(1 + place before) - log(1 + its place)`
    (places in `rank_places`; before: this interleaving of the earlier
    hops), so a block the earlier probes already ranked high (the template
    every look-alike shares) gives way to one the evidence they found newly
    points to. 0: each hop by its own scores."""
    if len(hops) == 1:
        return np.asarray(hops[0])
    n = len(hops[0])
    place = np.full(n, np.inf)
    for h, scores in enumerate(hops):
        rank = rank_places(scores)
        if gain and h:
            rank = rank_places(gain * np.log1p(rank_places(-place)) - np.log1p(rank))
        place = np.minimum(place, rank * len(hops) + h)
    return -place


def choose_blocks(
    ranked: Iterable[int], candidates: Container[int], limit: int, room: int, context_blocks: int = 0,
    passages: Passages | None = None, passage_blocks: int = 0, lines: Passages | None = None,
    first: Sequence[int] = (),
) -> list[int]:
    """The blocks a view's selection takes from `ranked` (best first), in
    the order taken: each block with what it brings (`passages.extent`: its
    neighbours or its passage), those among `candidates`, until `limit` are
    taken; with `lines`, each taken block's cut lines (`Passages.cut`) too,
    not counted against `limit`. `first`: blocks taken before `ranked`, each
    with what it brings, none counted against `limit`. Never more than
    `room` in all."""
    if (not context_blocks and not (passages is not None and passage_blocks > 0) and lines is None
            and not len(first)):
        # each block brings itself alone: the first distinct candidates, without `extent`'s tuples
        take, alone = min(limit, room), {}
        for block in ranked:
            if len(alone) >= take:
                break
            if block in candidates:
                alone[block] = None
        return list(alone)
    chosen: dict[int, None] = {}

    def complete_lines(block: int) -> None:  # a taken block's cut lines, uncounted
        if lines is not None and block in chosen:
            for b in lines.cut(block):
                if len(chosen) < room and b in candidates:
                    chosen.setdefault(b)

    for block in first:
        for b in extent(block, context_blocks, passages, passage_blocks):
            if len(chosen) < room and b in candidates:
                chosen.setdefault(b)
        complete_lines(block)
    counted = 0
    for block in ranked:
        for b in extent(block, context_blocks, passages, passage_blocks):
            if counted < limit and len(chosen) < room and b in candidates and b not in chosen:
                chosen[b] = None
                counted += 1
        complete_lines(block)
        if counted >= limit or len(chosen) >= room:
            break
    return list(chosen)


def final_pass(
    probe: ViewPass, scores: Sequence[float], budget: ViewBudget, context_blocks: int = 0,
    anchors: Sequence[int] = (), anchor_tokens: int = 0, reserved_tokens: int = 0,
    recompute_blocks: int = 0, recompute_in_order: bool = False,
    passages: Passages | None = None, passage_blocks: int = 0, select_blocks: int = 0,
    lines: Passages | None = None, first: Sequence[int] = (),
) -> ViewPass:
    """The view after `probe`: sink + the best-scoring candidates (in their
    original order) + recent + the same tail. `scores[i]` rates
    `probe.candidates[i]`; ties go to the later (more recent) block. With
    `context_blocks` > 0, each chosen block brings that many blocks on each
    side, as far as the room goes (a fact cut by a block boundary: its name
    in one block, its value in the next, and only one of them scores).
    With `passages` and `passage_blocks` > 0 instead, each chosen block
    brings the rest of its passage, nearest first, if the passage spans at
    most `passage_blocks` blocks (`Passages.around`): a paragraph or a
    document whole, as far as the room goes.

    A candidate scored -inf is never selected (a look-alike the job drops,
    `index.lookalikes`); the latest history may still hold it.

    `select_blocks` > 0: the selection stops at that many blocks (a block's
    neighbours or passage count); the room it leaves holds the latest history
    before the recent window, as a prompt cut to its end would. 0: the
    selection fills the room.

    `lines`: the history's lines (`Passages` over `BreakTokens.lines`); each
    chosen block also brings the neighbours holding the rest of a short line
    its boundaries cut (`Passages.cut`), as far as the room goes. They do not
    count against `select_blocks`: they complete what was selected.

    `first`: history blocks the selection takes before the ranked ones (the
    question's best passages by text retrieval, `view_question_passages`),
    each with what it brings, as far as the room goes; they do not count
    against `select_blocks`, and a look-alike among them is kept.

    `anchors`: virtual positions of history anchor tokens, most important
    first. Those outside the view's blocks, at most `anchor_tokens` of them,
    join the view as single tokens; the blocks' room shrinks by the whole
    blocks they take.

    `reserved_tokens`: budget to keep free for KV that is not a token of the
    pass (SeKV summaries), in whole blocks, never the last block of room; the
    view's `reserved_tokens` says how much was granted.

    `recompute_blocks`: of the chosen blocks (never sink or recent), the first
    this many in the order they were chosen (best score first, each with its
    neighbours) are recomputed in the view rather than restored; they count
    against the same room. They follow the restored history (recent
    included), unless `recompute_in_order`: then the view keeps virtual
    order, restoring the sink and the chosen blocks before the earliest of
    them (and only anchors before it) and recomputing every history block
    from there on, recent too."""
    if probe.kind is not PassKind.PROBE or len(scores) != len(probe.candidates):
        raise ValueError("final_pass needs a PROBE pass and one score per candidate")
    bt = probe.block_tokens
    history = probe.tail_start // bt
    sink, recent = _sink_and_recent(history, budget)
    room = budget.blocks - len(sink) - len(recent) - (-(-probe.tail_tokens // bt))
    reserved_blocks = min(-(-reserved_tokens // bt), max(room - 1, 0))
    room -= reserved_blocks
    anchor_room = max(0, min(anchor_tokens, (room - 1) * bt)) if anchors else 0
    room -= -(-anchor_room // bt)
    candidates = set(probe.candidates)
    order = rank_order(scores)
    order = order[np.asarray(scores, dtype=np.float64)[order] != -np.inf]  # look-alikes dropped: never selected
    ranked = np.asarray(probe.candidates, dtype=np.int64)[order].tolist()
    limit = min(room, select_blocks) if select_blocks > 0 else room
    chosen = dict.fromkeys(choose_blocks(ranked, candidates, limit, room, context_blocks, passages,
                                         passage_blocks, lines, first))  # in the order chosen
    # What the selection leaves of the room (`select_blocks`): the latest candidates it did not take.
    latest = list(itertools.islice((b for b in reversed(probe.candidates) if b not in chosen),
                                   max(0, room - len(chosen))))
    recomputed = sorted(list(chosen)[:recompute_blocks])
    if recompute_in_order and recomputed:
        recomputed = sorted(b for b in [*chosen, *latest] if b >= recomputed[0]) + recent
        recent = []
    blocks = sink + sorted((set(chosen) | set(latest)) - set(recomputed)) + recent
    held = set(blocks) | set(recomputed)
    # In virtual order, anchors (restored) must come before the recomputed history.
    end = recomputed[0] * bt if recompute_in_order and recomputed else history * bt
    kept = [p for p in anchors if p < end and p // bt not in held][:anchor_room]
    return ViewPass(PassKind.FINAL, bt, tuple(blocks), probe.tail_start, probe.tail_tokens,
                    anchors=tuple(sorted(kept)), reserved_tokens=min(reserved_tokens, reserved_blocks * bt),
                    recomputed=tuple(recomputed), ranked=tuple(chosen))
