"""Steps whose forward replays a full CUDA graph (vLLM's decode batches on
GPUs): no Python runs between the layers, so sekv's attention hook never
fires there. What the worker does instead, and how it finds those steps and
their slot mapping in each vLLM version. CPUs capture no graphs: the forward
contexts here are stand-ins with the attributes vLLM's have."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.config import CUDAGraphMode

from vllm_sekv import compat
from vllm_sekv.model_identity import KVGeometry
from vllm_sekv.connector import SekvConnector
from vllm_sekv.worker_side.probes import ProbeScorer
from vllm_sekv.ops import RopeSpec
from vllm_sekv.store import HostPool
from vllm_sekv.index.block_index import BlockIndex
from vllm_sekv.workspace.step_plan import ScoreOp

LAYERS, KV_HEADS, Q_HEADS, D, BT = 2, 2, 4, 8, 16
ROPE = RopeSpec(inv_freq=1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)), rotary_dim=D)


@pytest.mark.parametrize("context, full", [
    (SimpleNamespace(attn_metadata=None), True),  # vLLM 0.26 (V2 runner): loads start outside any context
    (SimpleNamespace(attn_metadata={}, cudagraph_runtime_mode=CUDAGraphMode.FULL), True),  # vLLM 0.32
    (SimpleNamespace(attn_metadata={}, cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE), False),
    (SimpleNamespace(attn_metadata={}, cudagraph_runtime_mode=CUDAGraphMode.NONE), False),  # eager, and CPUs
])
def test_a_full_graph_replay_is_told_from_the_forward_context(context, full):
    assert compat.full_graph_replay(context) is full


def test_the_slot_mapping_of_a_full_graph_step_is_read_from_vllms_persistent_buffer():
    """vLLM 0.26 fills one persistent buffer per KV-cache group before every
    forward and pads it with -1; a piecewise step's layers are handed a view
    of it. A later full-graph step's mapping is read from the same place."""
    buffer = torch.full((1, 32), -1, dtype=torch.int64)
    buffer[0, :5] = torch.tensor([40, 41, 42, 43, 44])  # a piecewise step of 5 tokens
    seen = buffer[0, :5]
    buffer[0, :5] = -1
    buffer[0, :2] = torch.tensor([45, 90])  # the next step: two decode rows
    mapping = compat.full_graph_slot_mapping(SimpleNamespace(attn_metadata=None), seen, 2)
    assert mapping.tolist() == [45, 90]
    assert compat.full_graph_slot_mapping(SimpleNamespace(attn_metadata=None), seen, 33) is None  # past the buffer
    assert compat.full_graph_slot_mapping(SimpleNamespace(attn_metadata=None), None, 2) is None  # none seen yet


def test_vllm_032_hands_the_mapping_in_the_forward_context():
    step = torch.tensor([7, 8, 9, -1])
    context = SimpleNamespace(attn_metadata={}, cudagraph_runtime_mode=CUDAGraphMode.FULL,
                              slot_mapping={"model.layers.0.self_attn.attn": step})
    assert compat.full_graph_slot_mapping(context, None, 3).tolist() == [7, 8, 9]


def test_decode_batches_may_replay_full_graphs_unless_every_step_needs_the_layers():
    assert not SekvConnector.requires_piecewise_for_cudagraph({})
    assert not SekvConnector.requires_piecewise_for_cudagraph({"view_tokens": 4096})
    assert SekvConnector.requires_piecewise_for_cudagraph({"surprisal": "on"})
    assert SekvConnector.requires_piecewise_for_cudagraph({"surprisal": "on", "coarse": "on"})


def _scorer():
    geometry = KVGeometry(num_layers=LAYERS, kv_heads=KV_HEADS, head_dim=D, dtype=torch.float32, world_size=1)
    index = BlockIndex(8, LAYERS, KV_HEADS, D, ROPE)
    pool = HostPool(8, LAYERS, BT, KV_HEADS, D, torch.float32)
    pool.data.copy_(torch.randn(pool.data.shape, generator=torch.Generator().manual_seed(0)))
    index.add_many(pool, [1, 2, 3], [0, BT, 2 * BT])
    return ProbeScorer(index, None, geometry, ROPE, BT, "max")


def _probe(last: bool) -> ScoreOp:
    return ScoreOp("r", query_paged_slots=np.array([100, 101]), query_positions=np.array([12, 13]),
                   candidate_slots=np.array([1, 2, 3]), candidate_starts=np.array([0, BT, 2 * BT]), last=last)


def test_a_probe_ending_in_a_full_graph_step_reports_what_it_scored_before():
    scorer = _scorer()
    first = _probe(last=False)
    scorer.begin([first], lambda slots: (np.ones(len(slots), bool), np.arange(len(slots))), torch.device("cpu"))
    queries = torch.randn(2, Q_HEADS * D, generator=torch.Generator().manual_seed(1))
    for layer in range(LAYERS):
        scorer.observe(layer, queries)
    assert scorer.take_done() == {}  # not its last step
    scorer.clear_step()
    scorer.unobserved([_probe(last=True)])
    rows = scorer.take_done()["r"]
    assert rows.shape == (1, 3) and rows.sum() > 0  # the first step's scores, combined


def test_a_probe_that_saw_no_query_reports_no_rows():
    """The scheduler side then ranks the candidates by recency (`set_scores`)."""
    scorer = _scorer()
    scorer.unobserved([_probe(last=False)])
    assert scorer.take_done() == {}
    scorer.unobserved([_probe(last=True)])
    assert scorer.take_done()["r"].shape == (0, 3)
