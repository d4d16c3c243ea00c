"""The token-level re-rank of a probe's best candidates (`worker_side.rerank`,
`ProbeScorer` with `rerank_blocks`): it equals the plain computation it
stands for, does not care where a block lies in the history, tells apart
blocks that differ in one token, and puts its blocks first in the report."""
import math

import numpy as np
import pytest
import torch

from vllm_sekv.model_identity import KVGeometry
from vllm_sekv.config import SekvConfig
from vllm_sekv.worker_side.probes import ProbeScorer
from vllm_sekv.worker_side.rerank import rerank
from vllm_sekv.ops import RopeSpec, rotate_keys
from vllm_sekv.store import HostPool
from vllm_sekv.index.block_index import BlockIndex
from vllm_sekv.workspace.step_plan import ScoreOp
from vllm_sekv.index.block_summaries import combine_heads

LAYERS, KV_HEADS, Q_HEADS, D, BT = 3, 2, 4, 16, 8
ROPE = RopeSpec(inv_freq=1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)), rotary_dim=D)


def _keys(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, LAYERS, BT, KV_HEADS, D, generator=torch.Generator().manual_seed(seed))


def _reference(queries, positions, keys, starts, distance, combine, heads=None):
    """Every candidate token at `min(positions) - distance + j`, one softmax
    over all of them per (layer, query head, query), mass summed per block
    and over queries, heads combined."""
    place = int(positions.min()) - distance
    n = keys.shape[0]
    moved = torch.stack([
        rotate_keys(keys[b].permute(1, 0, 2, 3).reshape(BT, LAYERS * KV_HEADS, D).double(),
                    torch.full((BT,), place - int(starts[b]), dtype=torch.int64), ROPE).reshape(BT, LAYERS, KV_HEADS, D)
        for b in range(n)])  # [n, T, L, Hkv, D]
    mass = torch.zeros(LAYERS, Q_HEADS, n, dtype=torch.float64)
    group = Q_HEADS // KV_HEADS
    for layer in range(LAYERS):
        for h in range(Q_HEADS):
            k = moved[:, :, layer, h // group].reshape(n * BT, D)
            logits = queries[layer, :, h].double() @ k.T / math.sqrt(D)  # [m, n*T]
            mass[layer, h] = torch.softmax(logits, -1).reshape(-1, n, BT).sum(-1).sum(0)
    if heads is not None:  # [(layer, head), ...]
        mass = torch.stack([mass[layer, h] for layer, h in heads])
    return combine_heads(mass, combine)


@pytest.mark.parametrize("combine", ["max", "mean"])
def test_rerank_equals_one_softmax_over_every_candidate_token(combine):
    keys = _keys(5, 0)
    starts = torch.tensor([0, 40, 96, 200, 512])
    queries = torch.randn(LAYERS, 6, Q_HEADS, D, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(300, 306)
    got = rerank(queries, positions, [0, 1, 2, 3, 4], starts, lambda slots: keys[slots], ROPE, 120, combine,
                 chunk_blocks=2)  # three chunks
    want = _reference(queries, positions, keys, starts, 120, combine)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_with_retrieval_heads_only_their_mass_is_combined():
    """`heads` (config `rerank_heads_path`): the combine runs over the listed
    (layer, query head) pairs only, in any order."""
    keys = _keys(4, 8)
    starts = torch.tensor([0, 64, 128, 400])
    queries = torch.randn(LAYERS, 5, Q_HEADS, D, generator=torch.Generator().manual_seed(9))
    positions = torch.arange(500, 505)
    heads = [(2, 1), (0, 3)]
    flat = torch.tensor([layer * Q_HEADS + h for layer, h in heads])
    for combine in ("max", "mean"):
        got = rerank(queries, positions, [0, 1, 2, 3], starts, lambda slots: keys[slots], ROPE, 100, combine,
                     heads=flat)
        want = _reference(queries, positions, keys, starts, 100, combine, heads)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_a_sink_in_a_head_outside_the_retrieval_heads_no_longer_outranks_the_asked_block():
    """Block 0 holds a token that one head attends whatever the query (a
    sink); block 1 holds the asked token, which another head finds. Over
    every head the sink's block wins; over the retrieval head, the asked one."""
    keys = torch.zeros(2, LAYERS, BT, KV_HEADS, D)
    needle = torch.zeros(D)
    needle[D // 2 - 1] = 1.0  # the slowest rotary pair: the blocks' placement hardly turns it
    queries = torch.zeros(LAYERS, 4, Q_HEADS, D)
    queries[..., 1, :] = 4 * needle        # query head 1 (KV head 0): looks for the asked token
    queries[..., 3, :] = 4 * needle        # query head 3 (KV head 1): the same query, ...
    keys[1, :, 5, 0] = 4 * needle          # ... but only KV head 0 of block 1 holds the asked token
    keys[0, :, 2, 1] = 40 * needle         # KV head 1 of block 0: a sink far stronger than any match
    queries = rotate_keys(queries.reshape(-1, 1, D), torch.zeros(LAYERS * 4 * Q_HEADS, dtype=torch.int64),
                          ROPE).reshape(LAYERS, 4, Q_HEADS, D)
    every = rerank(queries, torch.arange(4), [0, 1], torch.tensor([0, BT]), lambda s: keys[s], ROPE, 0, "max")
    retrieval = rerank(queries, torch.arange(4), [0, 1], torch.tensor([0, BT]), lambda s: keys[s], ROPE, 0, "max",
                       heads=torch.tensor([layer * Q_HEADS + 1 for layer in range(LAYERS)]))
    assert every[0] > every[1] and retrieval[1] > retrieval[0]


def test_a_blocks_score_does_not_depend_on_where_it_lies_in_the_history():
    keys = _keys(3, 2)
    queries = torch.randn(LAYERS, 4, Q_HEADS, D, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(90, 94)
    near = rerank(queries, positions, [0, 1, 2], torch.tensor([0, 32, 64]), lambda s: keys[s], ROPE, 50, "max")
    # The same keys, stored as if each block had been computed elsewhere in the history.
    starts = torch.tensor([1000, 4032, 20064])
    far_keys = torch.stack([
        rotate_keys(keys[b].permute(1, 0, 2, 3).reshape(BT, -1, D),
                    torch.full((BT,), int(starts[b]) - 32 * b, dtype=torch.int64), ROPE)
        .reshape(BT, LAYERS, KV_HEADS, D).permute(1, 0, 2, 3) for b in range(3)])
    far = rerank(queries, positions, [0, 1, 2], starts, lambda s: far_keys[s], ROPE, 50, "max")
    torch.testing.assert_close(far, near, rtol=1e-4, atol=1e-5)


def test_of_two_look_alike_blocks_the_one_with_the_asked_token_wins():
    """Two blocks equal but for one token; the queries look for that token's key."""
    keys = _keys(1, 4).repeat(2, 1, 1, 1, 1)
    needle = torch.randn(D, generator=torch.Generator().manual_seed(5))
    keys[1, :, 5, :] = 3 * needle  # block 1 holds the token asked for, every layer and head
    queries = (3 * needle).expand(LAYERS, 4, Q_HEADS, D).clone()
    queries = rotate_keys(queries.reshape(-1, 1, D), torch.full((LAYERS * 4 * Q_HEADS,), 0, dtype=torch.int64),
                          ROPE).reshape(LAYERS, 4, Q_HEADS, D)
    scores = rerank(queries, torch.arange(4), [0, 1], torch.tensor([0, BT]), lambda s: keys[s], ROPE, 0, "max")
    assert scores[1] > scores[0]


def _scorer(rerank_blocks: int) -> ProbeScorer:
    geometry = KVGeometry(num_layers=LAYERS, kv_heads=KV_HEADS, head_dim=D, dtype=torch.float32, world_size=1)
    index = BlockIndex(8, LAYERS, KV_HEADS, D, ROPE)
    pool = HostPool(8, LAYERS, BT, KV_HEADS, D, torch.float32)
    pool.data.copy_(torch.randn(pool.data.shape, generator=torch.Generator().manual_seed(6)))
    index.add_many(pool, [1, 2, 3, 4], [0, BT, 2 * BT, 3 * BT])
    return ProbeScorer(index, None, geometry, ROPE, BT, "max", rerank_blocks, 20,
                       lambda slots: pool.slot_keys_on(slots, torch.device("cpu")))


def _probe_rows(scorer: ProbeScorer, queries: torch.Tensor, extra: tuple[int, ...] = ()) -> np.ndarray:
    op = ScoreOp("r", query_paged_slots=np.array([100, 101, 102]), query_positions=np.array([40, 41, 42]),
                 candidate_slots=np.array([1, 2, 3, 4]), candidate_starts=np.array([0, BT, 2 * BT, 3 * BT]),
                 last=True, rerank_extra=np.array(extra, dtype=np.int64))
    scorer.begin([op], lambda slots: (np.ones(len(slots), bool), np.arange(len(slots))), torch.device("cpu"))
    for layer in range(LAYERS):
        scorer.observe(layer, queries[layer])
    return scorer.take_done()["r"]


def test_a_reranking_probe_reports_its_best_candidates_first_in_reranked_order():
    queries = torch.randn(LAYERS, 3, Q_HEADS * D, generator=torch.Generator().manual_seed(7))
    index_row = _probe_rows(_scorer(0), queries)[0]
    row = _probe_rows(_scorer(2), queries)[0]
    assert row.shape == (4,)
    best = np.argsort(-index_row)[:2]
    assert (row[best] >= 1).all() and (np.delete(row, best) < 1).all()
    scorer = _scorer(2)
    pool_keys = lambda slots: scorer.read_keys(slots)  # noqa: E731
    want = rerank(queries.reshape(LAYERS, 3, Q_HEADS, D), torch.tensor([40, 41, 42]),
                  [int(s) for s in np.array([1, 2, 3, 4])[best]], torch.tensor([0, BT, 2 * BT, 3 * BT])[best],
                  pool_keys, ROPE, 20, "max")
    np.testing.assert_allclose(row[best], 1 + want.numpy(), rtol=1e-5)


def test_the_schedulers_extra_candidates_are_reranked_beside_the_index_best():
    """`rerank_extra` (BM25's best, `lexical_candidates`): the index's worst
    candidate joins its best one in the re-rank, scored as if the index had
    chosen both."""
    queries = torch.randn(LAYERS, 3, Q_HEADS * D, generator=torch.Generator().manual_seed(7))
    index_row = _probe_rows(_scorer(0), queries)[0]
    best, worst = int(np.argmax(index_row)), int(np.argmin(index_row))
    row = _probe_rows(_scorer(1), queries, extra=(worst,))[0]
    both = [best, worst]
    assert (row[both] >= 1).all() and (np.delete(row, both) < 1).all()
    scorer = _scorer(1)
    want = rerank(queries.reshape(LAYERS, 3, Q_HEADS, D), torch.tensor([40, 41, 42]),
                  [int(s) for s in np.array([1, 2, 3, 4])[both]], torch.tensor([0, BT, 2 * BT, 3 * BT])[both],
                  scorer.read_keys, ROPE, 20, "max")
    np.testing.assert_allclose(row[both], 1 + want.numpy(), rtol=1e-5)
    again = _probe_rows(_scorer(1), queries, extra=(best,))[0]  # one the index chose anyway: counted once
    assert (again >= 1).sum() == 1


def test_rerank_blocks_is_checked_at_start_up():
    with pytest.raises(ValueError, match="'rerank_blocks'"):
        SekvConfig(rerank_blocks=-1)
    with pytest.raises(ValueError, match="'rerank_blocks'"):
        ProbeScorer(None, None, KVGeometry(num_layers=1, kv_heads=1, head_dim=D, dtype=torch.float32, world_size=2),
                    ROPE, BT, "max", 4, 10, lambda s: None)
