"""Sub-block (logsumexp) scoring: the reference against a float64 formula and
against `BlockIndex.score` (CPU), the Triton kernel against both (GPU)."""
import math

import pytest
import torch

from vllm_sekv.ops import RopeSpec
from vllm_sekv.store import HostPool
from vllm_sekv.ops.scoring.sub_block_reference import score_sub_blocks_reference
from vllm_sekv.index.block_index import BlockIndex


def _float64_scores(queries, entries, layer, slots, valid):
    """Direct restatement of the formula in float64: gather, repeat KV heads,
    logsumexp over S, softmax over the valid candidates only, sum over queries."""
    num_queries, q_heads, head_dim = queries.shape
    kv_heads = entries.shape[3]
    out = torch.zeros(q_heads, slots.shape[0], dtype=torch.float64, device=queries.device)
    ok = valid[slots]
    if not bool(ok.any()) or num_queries == 0:
        return out
    k = entries[slots[ok], layer].double().repeat_interleave(q_heads // kv_heads, dim=2)  # [B', S, Hq, D]
    dots = torch.einsum("mhd,bshd->mhbs", queries.double(), k) / math.sqrt(head_dim)
    logit = torch.logsumexp(dots, dim=-1)  # [M, Hq, B']
    out[:, ok] = torch.softmax(logit, dim=-1).sum(dim=0)
    return out


def _case(seed, num_queries, q_heads, kv_heads, s, head_dim, num_slots, num_cands, layers=3,
          entry_dtype=torch.float32, query_dtype=torch.float32, p_valid=0.7, device="cpu", q_scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    entries = torch.randn(num_slots, layers, s, kv_heads, head_dim, generator=gen).to(entry_dtype)
    valid = torch.rand(num_slots, generator=gen) < p_valid
    entries[~valid] = float("nan")  # never-indexed slots hold garbage; it must not matter
    slots = torch.randint(0, num_slots, (num_cands,), generator=gen)  # repeats, any order
    queries = (torch.randn(num_queries, q_heads, head_dim, generator=gen) * q_scale).to(query_dtype)
    return [t.to(device) for t in (queries, entries)] + [layers - 1] + [t.to(device) for t in (slots, valid)]


CPU_CASES = [  # seed, M, Hq, H, S, D, num_slots, B
    pytest.param(1, 5, 6, 2, 8, 16, 12, 9, id="gqa3-S8"),
    pytest.param(2, 3, 4, 4, 1, 8, 10, 7, id="mha-S1"),
    pytest.param(3, 1, 8, 4, 8, 32, 20, 40, id="gqa2-S8-M1-repeats"),
    pytest.param(4, 17, 4, 1, 2, 16, 6, 5, id="mqa-S2"),
]


@pytest.mark.parametrize("entry_dtype,query_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                     (torch.bfloat16, torch.bfloat16)], ids=["f32", "bf16-f32q", "bf16"])
@pytest.mark.parametrize("seed,m,hq,h,s,d,num_slots,b", CPU_CASES)
def test_reference_matches_float64_formula(seed, m, hq, h, s, d, num_slots, b, entry_dtype, query_dtype):
    q, e, layer, slots, valid = _case(seed, m, hq, h, s, d, num_slots, b, entry_dtype=entry_dtype,
                                      query_dtype=query_dtype)
    got = score_sub_blocks_reference(q, e, layer, slots, valid)
    want = _float64_scores(q, e, layer, slots, valid)
    assert got.dtype == torch.float32 and got.shape == (hq, b)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    ok = valid[slots]
    assert torch.all(got[:, ~ok] == 0)  # invalid candidates score exactly 0
    if ok.any():  # each (query, head) spreads mass 1 over the valid candidates
        torch.testing.assert_close(got.sum(-1), torch.full((hq,), float(m)))


def test_reference_repeated_and_permuted_slots():
    q, e, layer, _, valid = _case(7, 4, 4, 2, 8, 16, 8, 1, p_valid=1.0)
    slots = torch.tensor([5, 2, 5, 0, 7, 2])
    got = score_sub_blocks_reference(q, e, layer, slots, valid)
    torch.testing.assert_close(got[:, 0], got[:, 2])  # the same block twice: equal shares
    perm = torch.tensor([3, 1, 0, 5, 4, 2])
    torch.testing.assert_close(score_sub_blocks_reference(q, e, layer, slots[perm], valid), got[:, perm])


def test_reference_edge_cases():
    q, e, layer, slots, valid = _case(8, 3, 6, 2, 8, 16, 6, 5)
    none = torch.zeros_like(valid)
    out = score_sub_blocks_reference(q, e, layer, slots, none)
    assert out.shape == (6, 5) and torch.all(out == 0)  # nothing valid: 0, not NaN
    assert score_sub_blocks_reference(q, e, layer, slots[:0], valid).shape == (6, 0)
    out = score_sub_blocks_reference(q[:0], e, layer, slots, valid)
    assert out.shape == (6, 5) and torch.all(out == 0)


def test_reference_rejects_bad_arguments():
    q, e, layer, slots, valid = _case(9, 3, 4, 2, 8, 16, 6, 5)
    with pytest.raises(ValueError, match="queries"):
        score_sub_blocks_reference(q[0], e, layer, slots, valid)
    with pytest.raises(ValueError, match="multiple"):
        score_sub_blocks_reference(torch.randn(3, 3, 16), e, layer, slots, valid)
    with pytest.raises(ValueError, match="head_dim"):
        score_sub_blocks_reference(torch.randn(3, 4, 8), e, layer, slots, valid)
    with pytest.raises(ValueError, match="entries"):
        score_sub_blocks_reference(q, e[:, 0], layer, slots, valid)
    with pytest.raises(ValueError, match="layer"):
        score_sub_blocks_reference(q, e, 3, slots, valid)
    with pytest.raises(ValueError, match="slots"):
        score_sub_blocks_reference(q, e, layer, slots.int(), valid)
    with pytest.raises(ValueError, match="valid"):
        score_sub_blocks_reference(q, e, layer, slots, valid[:-1])
    with pytest.raises(ValueError, match="valid"):
        score_sub_blocks_reference(q, e, layer, slots, valid.int())


@pytest.mark.parametrize("kind", ["sub4_pre", "mean_pre"])
def test_reference_equals_block_index_score(kind):
    num_slots, layers, tokens, kv_heads, head_dim = 7, 2, 16, 2, 16
    gen = torch.Generator().manual_seed(11)
    pool = HostPool(num_slots, layers, tokens, kv_heads, head_dim, torch.float32)
    pool.data.copy_(torch.randn(pool.data.shape, generator=gen))
    inv = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    index = BlockIndex(num_slots, layers, kv_heads, head_dim, RopeSpec(inv_freq=inv, rotary_dim=head_dim),
                       kind=kind)  # bfloat16 entries, as served
    index.add_many(pool, [0, 2, 3, 5], [0, 16, 64, 32])
    slots = torch.tensor([5, 1, 0, 3, 3, 2, 6])  # 1 and 6 never indexed; 3 twice
    q = torch.randn(4, 4, head_dim, generator=gen) * 2
    for layer in range(layers):
        want = index.score(layer, q, slots)
        got = score_sub_blocks_reference(q, index.entries, layer, slots, index.valid)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert torch.all(got[:, 1] == 0) and torch.all(got[:, 6] == 0)


def test_kernel_validates_on_cpu():
    pytest.importorskip("triton")
    from vllm_sekv.ops.scoring import sub_block_scoring as sub_blocks

    q, e, layer, slots, valid = _case(12, 3, 4, 2, 8, 16, 6, 5)
    with pytest.raises(ValueError, match="head_dim"):
        sub_blocks.score_sub_blocks(torch.randn(3, 4, 24), torch.randn(6, 3, 8, 2, 24), layer, slots, valid)
    with pytest.raises(ValueError, match="vectors per block"):
        sub_blocks.score_sub_blocks(q, torch.randn(6, 3, 5, 2, 16), layer, slots, valid)
    with pytest.raises(ValueError, match="layer"):
        sub_blocks.score_sub_blocks(q, e, -1, slots, valid)
    if not sub_blocks._INTERPRET:
        with pytest.raises(ValueError, match="CUDA"):
            sub_blocks.score_sub_blocks(q, e, layer, slots, valid)
    with pytest.raises(ValueError, match="power of two"):
        sub_blocks.SubBlockConfig(lse_block_v=24)


# ---------------------------------------------------------------- GPU

GPU_CASES = [  # seed, M, Hq, H, S, D, num_slots, B, entry dtype, query dtype
    pytest.param(21, 64, 32, 8, 8, 128, 5000, 4096, torch.bfloat16, torch.float32, id="sub4-llama-B4096"),
    pytest.param(22, 64, 32, 8, 1, 128, 11000, 10000, torch.bfloat16, torch.float32, id="mean-llama-B10000"),
    pytest.param(23, 5, 12, 4, 4, 64, 400, 333, torch.float16, torch.float32, id="gqa3-S4-M5-fp16"),
    pytest.param(24, 17, 8, 8, 2, 32, 120, 100, torch.float32, torch.float32, id="mha-S2-fp32"),
    pytest.param(25, 40, 16, 2, 16, 16, 64, 70, torch.bfloat16, torch.bfloat16, id="gqa8-S16-bf16q-repeats"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("seed,m,hq,h,s,d,num_slots,b,edt,qdt", GPU_CASES)
def test_kernel_matches_reference(seed, m, hq, h, s, d, num_slots, b, edt, qdt):
    from vllm_sekv.ops.scoring import sub_block_scoring as sub_blocks

    q, e, layer, slots, valid = _case(seed, m, hq, h, s, d, num_slots, b, layers=2, entry_dtype=edt,
                                      query_dtype=qdt, p_valid=0.95, device="cuda", q_scale=2.0)
    got = sub_blocks.score_sub_blocks(q, e, layer, slots, valid)
    assert got.shape == (hq, b) and got.dtype == torch.float32 and torch.isfinite(got).all()
    assert torch.all(got[:, ~valid[slots]] == 0)
    # (1) float64 formula on the queries as given: float32 queries against 16-bit
    # entries are split into two 16-bit parts (about 16 significant bits, ~1e-5
    # relative per logit); 16-bit queries are used as they are. What remains is
    # fp32 accumulation order and the exp2/log2 approximations: 1e-3 is loose.
    want64 = _float64_scores(q, e, layer, slots, valid)
    torch.testing.assert_close(got.double(), want64, rtol=1e-3, atol=1e-6)
    # (2) Against the float32 reference (which the CPU index runs): as close.
    want = score_sub_blocks_reference(q, e, layer, slots, valid)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)
    assert ((got - want).norm() / want.norm()).item() < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_edge_cases_and_no_host_sync():
    from vllm_sekv.ops.scoring import sub_block_scoring as sub_blocks

    q, e, layer, slots, valid = _case(31, 9, 8, 2, 8, 64, 50, 45, device="cuda", entry_dtype=torch.bfloat16)
    small = sub_blocks.SubBlockConfig(16, 16, 4, 1, 16, 16, 4, 1, lse_splits=3)
    for cfg in (None, small):
        got = sub_blocks.score_sub_blocks(q, e, layer, slots, valid, cfg)
        torch.testing.assert_close(got.double(), _float64_scores(q, e, layer, slots, valid),
                                   rtol=1e-3, atol=1e-6)
        none = sub_blocks.score_sub_blocks(q, e, layer, slots, torch.zeros_like(valid), cfg)
        assert torch.all(none == 0)  # nothing valid: zeros, not NaN
    assert sub_blocks.score_sub_blocks(q, e, layer, slots[:0], valid).shape == (8, 0)
    assert torch.all(sub_blocks.score_sub_blocks(q[:0], e, layer, slots, valid) == 0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside raises
    try:
        sub_blocks.score_sub_blocks(q, e, layer, slots, valid)
        sub_blocks.score_sub_blocks(q, e, layer, slots, valid, small)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_matches_block_index_score_on_cuda():
    from vllm_sekv.ops.scoring import sub_block_scoring as sub_blocks

    inv = 1.0 / 10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    index = BlockIndex(300, 4, 2, 64, RopeSpec(inv_freq=inv, rotary_dim=64), kind="sub4_pre", device="cuda")
    index.entries.normal_()
    index.valid[:250] = True
    slots = torch.randperm(300, device="cuda")[:280]
    q = torch.randn(16, 8, 64, device="cuda")
    for layer in (0, 3):
        got = sub_blocks.score_sub_blocks(q, index.entries, layer, slots, index.valid)
        index.fused = False  # its eager PyTorch path, in float32
        want = index.score(layer, q, slots)
        index.fused = True
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)
