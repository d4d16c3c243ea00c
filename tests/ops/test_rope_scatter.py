"""Scatter + re-RoPE: the reference against a per-token loop (CPU), re-RoPE
exactness against vLLM's own rotary embeddings per rope type (CPU, needs vLLM),
and the Triton kernel against the reference (GPU)."""

import pytest
import torch

from vllm_sekv.ops import RopeSpec
from vllm_sekv.ops.rope.rotate_reference import rotate_keys
from vllm_sekv.ops.rope.scatter_reference import scatter_rerope


def _rope(rotary_dim, neox=True, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    return RopeSpec(inv_freq=inv, rotary_dim=rotary_dim, is_neox_style=neox)


def _case(n_rows, layers, bt, heads, dim, pages, page_size, dtype, device="cpu", head_major=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    staging = torch.randn(n_rows, 2, layers, bt, heads, dim, generator=gen).to(dtype).to(device)
    if head_major:  # [pages, heads, page_size, dim] storage, viewed as [pages, page_size, heads, dim]
        kv = torch.randn(layers, 2, pages, heads, page_size, dim, generator=gen).to(dtype).to(device)
        keys = [kv[l, 0].transpose(1, 2) for l in range(layers)]
        vals = [kv[l, 1].transpose(1, 2) for l in range(layers)]
    else:  # vLLM FlashAttention: per layer [2, pages, page_size, heads, dim]
        kv = torch.randn(layers, 2, pages, page_size, heads, dim, generator=gen).to(dtype).to(device)
        keys = [kv[l, 0] for l in range(layers)]
        vals = [kv[l, 1] for l in range(layers)]
    return staging, kv, keys, vals


def _slots(n_tokens, pages, page_size, seed, skip_every=5):
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(pages * page_size, generator=gen)[:n_tokens]
    slots[::skip_every] = -1
    deltas = torch.randint(-5000, 200000, (n_tokens,), generator=gen)
    return slots, deltas


@pytest.mark.parametrize("head_major", [False, True], ids=["nhd", "hnd"])
@pytest.mark.parametrize("rows", [None, [2, 0]], ids=["all-rows", "src-rows"])
def test_reference_matches_token_loop(head_major, rows):
    layers, bt, heads, dim, pages, page_size = 2, 4, 3, 8, 6, 3
    staging, kv, keys, vals = _case(3, layers, bt, heads, dim, pages, page_size, torch.float32, head_major=head_major)
    before = kv.clone()
    src_rows = None if rows is None else torch.tensor(rows)
    n_blocks = 3 if rows is None else len(rows)
    slots, deltas = _slots(n_blocks * bt, pages, page_size, seed=1)
    rope = _rope(6)  # partial rotary: dims 6..7 pass through
    scatter_rerope(staging, keys, vals, slots, deltas, rope, src_rows)
    expect = before.clone()
    for n in range(n_blocks * bt):
        if slots[n] < 0:
            continue
        row = n // bt if rows is None else rows[n // bt]
        page, off = divmod(int(slots[n]), page_size)
        for l in range(layers):
            k = rotate_keys(staging[row, 0, l, n % bt][None], deltas[n:n + 1], rope)[0]
            ek = expect[l, 0, page] if not head_major else expect[l, 0, page].transpose(0, 1)
            ev = expect[l, 1, page] if not head_major else expect[l, 1, page].transpose(0, 1)
            ek[off] = k
            ev[off] = staging[row, 1, l, n % bt]
    torch.testing.assert_close(kv, expect, rtol=0, atol=0)


def test_reference_rejects_mismatch():
    staging, _, keys, vals = _case(2, 2, 4, 3, 8, 4, 4, torch.float32)
    with pytest.raises(ValueError, match="slot_mapping"):
        scatter_rerope(staging, keys, vals, torch.zeros(7, dtype=torch.long), torch.zeros(7, dtype=torch.long), _rope(8))
    with pytest.raises(ValueError, match="caches"):
        scatter_rerope(staging, keys[:1], vals, torch.zeros(8, dtype=torch.long), torch.zeros(8, dtype=torch.long), _rope(8))


# --- re-RoPE exactness against vLLM's rotary embeddings -------------------------------

ROPE_TYPES = {
    "default": {"rope_type": "default", "rope_theta": 500000.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4096},
}


def rope_spec_from_vllm(emb) -> RopeSpec:
    """Effective inverse frequencies of a vLLM rotary embedding (test helper)."""
    from vllm.model_executor.layers.rotary_embedding import (
        LinearScalingRotaryEmbedding, YaRNScalingRotaryEmbedding)

    if isinstance(emb, YaRNScalingRotaryEmbedding):
        inv = emb._compute_inv_freq(emb.scaling_factor)
    elif isinstance(emb, LinearScalingRotaryEmbedding):
        (factor,) = emb.scaling_factors
        inv = emb._compute_inv_freq(emb.base) / factor
    else:  # default, llama3 (its _compute_inv_freq applies the smoothing)
        inv = emb._compute_inv_freq(emb.base)
    return RopeSpec(inv_freq=inv.to(torch.float64), rotary_dim=emb.rotary_dim, is_neox_style=emb.is_neox_style)


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "interleaved"])
@pytest.mark.parametrize("rope_type", list(ROPE_TYPES))
def test_rerope_matches_vllm_rope(rope_type, neox):
    rotary = pytest.importorskip("vllm.model_executor.layers.rotary_embedding")
    head_dim, heads, tokens = 64, 2, 48
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):  # vLLM's CustomOps need a config
        emb = rotary.get_rope(head_dim, 16384, is_neox_style=neox, rope_parameters=dict(ROPE_TYPES[rope_type]),
                              dtype=torch.float32)
    spec = rope_spec_from_vllm(emb)
    gen = torch.Generator().manual_seed(7)
    raw = torch.randn(tokens, heads * head_dim, generator=gen)
    p = torch.randint(0, 16000, (tokens,), generator=gen)
    p_new = torch.randint(0, 16000, (tokens,), generator=gen)

    def vllm_key(pos):
        q = torch.zeros_like(raw)
        _, k = emb.forward_native(pos, q, raw.clone())
        return k.view(tokens, heads, head_dim)

    k_old, k_new = vllm_key(p), vllm_key(p_new)
    # float32 keys: the only error is vLLM's own float32 angle table.
    got32 = rotate_keys(k_old, p_new - p, spec)
    assert (got32 - k_new).norm() / k_new.norm() < 2e-4
    # bf16 keys as stored in the cache: one bf16 rounding before and after.
    got16 = rotate_keys(k_old.to(torch.bfloat16), p_new - p, spec).float()
    assert (got16 - k_new).norm() / k_new.norm() < 8e-3


# --- Triton kernel against the reference (GPU) ----------------------------------------

GPU_CASES = [  # rows, layers, block_tokens, heads, head_dim, rotary_dim, neox, pages, page_size
    pytest.param(5, 3, 32, 8, 128, 128, True, 64, 16, id="llama-like-neox"),
    pytest.param(3, 2, 7, 3, 64, 64, False, 9, 5, id="odd-interleaved"),
    pytest.param(4, 2, 32, 2, 96, 48, True, 40, 16, id="partial-rotary-D96"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("head_major", [False, True], ids=["nhd", "hnd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("rows,layers,bt,heads,dim,rd,neox,pages,page_size", GPU_CASES)
def test_kernel_matches_reference(rows, layers, bt, heads, dim, rd, neox, pages, page_size, dtype, head_major):
    from vllm_sekv.ops.rope import scatter as kernel

    staging, kv_ref, keys_ref, vals_ref = _case(rows, layers, bt, heads, dim, pages, page_size, dtype, "cuda",
                                                head_major, seed=3)
    kv_tri = kv_ref.clone()
    if head_major:
        keys_tri = [kv_tri[l, 0].transpose(1, 2) for l in range(layers)]
        vals_tri = [kv_tri[l, 1].transpose(1, 2) for l in range(layers)]
    else:
        keys_tri = [kv_tri[l, 0] for l in range(layers)]
        vals_tri = [kv_tri[l, 1] for l in range(layers)]
    src_rows = torch.tensor([rows - 1, 0, 1], device="cuda")
    slots, deltas = _slots(3 * bt, pages, page_size, seed=4)
    rope = _rope(rd, neox)
    scatter_rerope(staging, keys_ref, vals_ref, slots.cuda(), deltas.cuda(), rope, src_rows)
    kernel.scatter_rerope(staging, keys_tri, vals_tri, slots.cuda(), deltas.cuda(), rope, src_rows)
    # Same float32 cos/sin and float32 rotation; at most one rounding step apart.
    torch.testing.assert_close(kv_tri.float(), kv_ref.float(), rtol=1e-2 if dtype == torch.bfloat16 else 2e-3,
                               atol=1e-2 if dtype == torch.bfloat16 else 2e-3)
    assert (kv_tri != kv_ref).float().mean() < 0.01  # nearly all bit-identical


def test_reference_without_deltas_copies_keys_bit_for_bit():
    """No deltas: keys land as staged (signed zeros too), not rotated by zero."""
    layers, bt, heads, dim, pages, page_size = 2, 4, 3, 8, 6, 3
    staging, kv, keys, vals = _case(3, layers, bt, heads, dim, pages, page_size, torch.bfloat16)
    staging[:, 0, :, ::2] = -0.0
    slots, _ = _slots(2 * bt, pages, page_size, seed=1)
    scatter_rerope(staging, keys, vals, slots, None, _rope(6), torch.tensor([2, 0]))
    keep = slots >= 0
    page, off = slots[keep] // page_size, slots[keep] % page_size
    for l in range(layers):
        for half, caches in ((0, keys), (1, vals)):
            want = staging[[2, 0], half, l].reshape(-1, heads, dim)[keep]
            assert torch.equal(caches[l][page, off].view(torch.int16), want.view(torch.int16))
