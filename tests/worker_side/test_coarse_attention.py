"""SeKV coarse attention on the worker (`worker_side/coarse_attention.py`), against exact
attention: merging summaries into a view's attention must equal attending to
the view's keys plus each summary repeated as many times as the tokens it
stands for, with the summary built from the host pool exactly as specified
(surprisal-weighted mean of pre-RoPE keys, rotated to its view position)."""
import math

import numpy as np
import pytest
import torch

from vllm_sekv.worker_side import coarse_attention
from vllm_sekv.worker_side.coarse_attention import CoarseAttention, StepRows
from vllm_sekv.ops import RopeSpec, rotate_keys
from vllm_sekv.store import HostPool
from vllm_sekv.ops.coarse.coarse_reference import attention_with_lse
from vllm_sekv.workspace.step_plan import CoarseSummaries

L, H, HQ, D, BT = 2, 2, 4, 8, 8


def rope():
    return RopeSpec(inv_freq=1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)), rotary_dim=D)


def setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    pool = HostPool(6, L, BT, H, D, torch.float32)
    pool.data.copy_(torch.randn(pool.data.shape, generator=g))
    # Summarized: 10 rows of slots 2 and 3 (virtual positions 16.. of a history), in 3 summaries.
    rows = np.array([16, 17, 18, 19, 21, 22, 24, 25, 26, 30], dtype=np.int64)
    virtual = rows + 100  # slot 2 holds virtual block 14 (positions 112..), slot 3 block 15
    spec = CoarseSummaries(rows, virtual, np.array([0, 0, 0, 1, 1, 1, 2, 2, 2, 2]),
                           np.array([1, 2, 0.5, 0, 0, 0, 3, 1, 1, 1], dtype=np.float32),
                           np.array([5, 5, 9]), np.array([3, 3, 4]), history_tokens=12)
    history = torch.randn((L, 12, H, D), generator=g)  # the view's restored keys, positions 0..11
    return pool, spec, history, g


def expected_summaries(pool, spec, r):
    rows = torch.from_numpy(spec.host_rows)
    k = pool.data[rows // BT, 0, :, rows % BT]  # [n, L, H, D]
    v = pool.data[rows // BT, 1, :, rows % BT]
    pre = rotate_keys(k.reshape(len(rows), L * H, D), -torch.from_numpy(spec.virtual_positions), r)
    pre = pre.reshape(len(rows), L, H, D)
    ks, vs = [], []
    for s in range(len(spec.num_tokens)):
        sel = torch.from_numpy(spec.summary_of == s)
        h = torch.from_numpy(spec.surprisal)[sel]
        w = h / h.sum() if h.sum() > 0 else torch.full_like(h, 1.0 / len(h))
        ks.append((w[:, None, None, None] * pre[sel]).sum(0))
        vs.append((w[:, None, None, None] * v[sel]).sum(0))
    k_sum = torch.stack(ks)  # [S, L, H, D]
    pos = torch.from_numpy(spec.summary_positions)
    k_sum = rotate_keys(k_sum.reshape(-1, L * H, D), pos, r).reshape(-1, L, H, D)
    return k_sum, torch.stack(vs)


def test_merged_attention_equals_attention_over_view_and_expanded_summaries():
    pool, spec, history, g = setup()
    r = rope()
    coarse = CoarseAttention(L, H, D, torch.float32, torch.device("cpu"), r)
    coarse.begin("req", spec, lambda rows: pool.rows_on(rows, torch.device("cpu")), history, 0)
    k_sum, v_sum = expected_summaries(pool, spec, r)
    # A step of 3 new tokens at view positions 12..14, in a batch of 5 rows.
    positions = torch.tensor([12, 13, 14])
    rows = torch.tensor([4, 0, 2])
    step = StepRows.of(rows.numpy(), positions.numpy(), torch.device("cpu"))
    scale = 1.0 / math.sqrt(D)
    for layer in range(L):
        new_k = torch.randn((3, H, D), generator=g)
        new_v = torch.randn((3, H, D), generator=g)
        hist_v = torch.randn((12, H, D), generator=g)
        coarse.keys_written("req", layer, new_k, step)
        q = torch.randn((5, HQ, D), generator=g)
        view_k, view_v = torch.cat([history[layer], new_k]), torch.cat([hist_v, new_v])
        out_view, _ = attention_with_lse(q[rows], view_k, view_v, scale, causal_offset=12)
        output = torch.zeros((5, HQ, D))
        output[rows] = out_view
        coarse.merge("req", layer, q, output, step, scale)
        # Exact: the view's keys (causal) + summary s repeated n_s times (always visible).
        rep = torch.repeat_interleave(torch.arange(3), torch.from_numpy(spec.num_tokens))
        keys = torch.cat([view_k, k_sum[rep, layer]])
        values = torch.cat([view_v, v_sum[rep, layer]])
        mask = torch.ones((3, len(keys)), dtype=torch.bool)
        mask[:, :15] = torch.arange(15)[None, :] <= positions[:, None]
        want, _ = attention_with_lse(q[rows], keys, values, scale, mask=mask)
        torch.testing.assert_close(output[rows], want, atol=1e-5, rtol=1e-5)
        assert torch.equal(output[[1, 3]], torch.zeros((2, HQ, D)))  # other rows untouched


def test_rows_whose_view_keys_are_not_all_known_are_left_alone():
    pool, spec, history, g = setup()
    coarse = CoarseAttention(L, H, D, torch.float32, torch.device("cpu"), rope())
    coarse.begin("req", spec, lambda rows: pool.rows_on(rows, torch.device("cpu")), history[:, 4:], 4)  # 0..3 unwritten
    q, output = torch.randn((2, HQ, D), generator=g), torch.randn((2, HQ, D), generator=g)
    before = output.clone()
    coarse.merge("req", 0, q, output, StepRows.of(np.array([0, 1]), np.array([12, 13]), torch.device("cpu")), 0.3)
    assert torch.equal(output, before) and coarse.skipped_rows == 2
    coarse.finish(["req"])
    assert not coarse.requests


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.mark.parametrize("device", DEVICES)
def test_summaries_built_a_few_rows_at_a_time_on_the_device_equal_the_specified_ones(monkeypatch, device):
    """The rows are read and summed in chunks (3 rows here, where summaries
    span chunks), from the pool's whole slots moved to the device."""
    pool, spec, history, _ = setup()
    if device == "cuda":
        pinned = HostPool(6, L, BT, H, D, torch.float32, pin_memory=True)
        pinned.data.copy_(pool.data)
        pool = pinned
    r = rope()
    monkeypatch.setattr(coarse_attention, "CHUNK_ROWS", 3)
    coarse = CoarseAttention(L, H, D, torch.float32, torch.device(device), r)
    coarse.begin("req", spec, lambda rows: pool.rows_on(rows, torch.device(device)), history.to(device), 0)
    k_sum, v_sum = expected_summaries(pool, spec, r)
    state = coarse.requests["req"]
    torch.testing.assert_close(state.k_sum.cpu(), k_sum.transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.v_sum.cpu(), v_sum.transpose(0, 1), atol=1e-5, rtol=1e-5)
