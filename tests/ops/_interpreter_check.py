"""Run by test_interpreter.py in a subprocess with TRITON_INTERPRET=1: the Triton
kernels execute on CPU through Triton's interpreter and must match the
references. Exits non-zero (AssertionError) on a mismatch."""
import functools

import numpy
import torch

from vllm_sekv.ops.rope import scatter as rope_kernel
from vllm_sekv.ops.rope import rotate_reference as rope_reference
from vllm_sekv.ops.rope import dequant as rope_dequant
from vllm_sekv.ops.rope import dequant_reference
from vllm_sekv.ops.rope import gather as rope_gather
from vllm_sekv.ops.rope import rotate as rope_rotate
from vllm_sekv.ops.rope import scatter_reference
from vllm_sekv.ops.rope.rope_spec import RopeSpec
from vllm_sekv.ops.coarse import coarse_kernel
from vllm_sekv.ops.coarse import coarse_reference
from vllm_sekv.ops.scoring import sub_block_reference
from vllm_sekv.ops.scoring import sub_block_scoring as sub_blocks
from vllm_sekv.store.fp8 import quantize as fp8_quantize

torch.manual_seed(0)
for neox, rotary_dim, head_dim in [(True, 64, 64), (False, 32, 32), (True, 48, 96)]:
    layers, bt, heads, pages, page_size = 2, 8, 3, 12, 4
    staging = torch.randn(3, 2, layers, bt, heads, head_dim).half()
    kv_ref = torch.randn(layers, 2, pages, heads, page_size, head_dim).half()  # head-major storage
    kv_tri = kv_ref.clone()
    kv_tri2 = kv_ref.clone()
    inv = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    rope = RopeSpec(inv, rotary_dim, neox)
    slots = torch.randperm(pages * page_size)[:2 * bt]
    slots[::5] = -1
    deltas = torch.randint(-100, 100000, (2 * bt,))
    src_rows = torch.tensor([2, 0])
    two_heads_per_prog = functools.partial(rope_kernel.scatter_rerope, heads_per_prog=2)  # 3 heads: a ragged group
    for kv, fn in ((kv_ref, scatter_reference.scatter_rerope), (kv_tri, rope_kernel.scatter_rerope),
                   (kv_tri2, two_heads_per_prog)):
        fn(staging, [kv[l, 0].transpose(1, 2) for l in range(layers)], [kv[l, 1].transpose(1, 2) for l in range(layers)],
           slots, deltas, rope, src_rows)
    torch.testing.assert_close(kv_tri, kv_ref, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(kv_tri2, kv_ref, rtol=1e-3, atol=1e-3)
# Keys not moved (no deltas): copied bit for bit, signed zeros too, as values are.
for head_dim, rotary_dim in [(64, 64), (96, 48)]:
    layers, bt, heads, pages, page_size = 2, 8, 3, 12, 4
    staging = torch.randn(3, 2, layers, bt, heads, head_dim).to(torch.bfloat16)
    staging[0, 0, :, :2] = -0.0  # a rotation by zero would give some of them back as +0.0
    inv = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    rope = RopeSpec(inv, rotary_dim, True)
    slots = torch.randperm(pages * page_size)[:2 * bt]
    slots[::5] = -1
    kv_ref = torch.randn(layers, 2, pages, heads, page_size, head_dim).to(torch.bfloat16)
    kv_tri = kv_ref.clone()
    for kv, fn in ((kv_ref, scatter_reference.scatter_rerope), (kv_tri, rope_kernel.scatter_rerope)):
        fn(staging, [kv[l, 0].transpose(1, 2) for l in range(layers)],
           [kv[l, 1].transpose(1, 2) for l in range(layers)], slots, None, rope, torch.tensor([0, 2]))
    assert torch.equal(kv_tri.view(torch.int16), kv_ref.view(torch.int16))
    written = kv_tri[:, 0].transpose(2, 3).reshape(layers, -1, heads, head_dim)[:, slots[:bt][slots[:bt] >= 0]]
    want = staging[0, 0].reshape(layers, bt, heads, head_dim)[:, slots[:bt] >= 0]
    assert torch.equal(written.view(torch.int16), want.view(torch.int16))  # the staged bits, -0.0 kept
# fp8 staging with scales (workspace_codec fp8): dequantized, rotated in
# float32, rounded once. fp16 caches: bit-identical to the reference; bf16
# caches: within 2 bf16 ulps (the interpreter's float32 -> bfloat16 cast
# rounds differently from torch's).

for neox, rotary_dim, head_dim in [(True, 64, 64), (False, 32, 32), (True, 48, 96)]:
    for cache_dtype in (torch.float16, torch.bfloat16):
        layers, bt, heads, pages, page_size = 2, 8, 3, 12, 4
        kv8 = torch.randn(3, 2, layers, bt, heads, head_dim) * 3 + torch.randn(heads, head_dim) * 20  # channel offsets
        q8, sc8, _ = fp8_quantize(kv8, token_dim=3)
        kv_ref = torch.randn(layers, 2, pages, heads, page_size, head_dim).to(cache_dtype)
        kv_tri = kv_ref.clone()
        inv = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
        rope = RopeSpec(inv, rotary_dim, neox)
        slots = torch.randperm(pages * page_size)[:2 * bt]
        slots[::5] = -1
        deltas = torch.randint(-100, 100000, (2 * bt,))
        for moved in (deltas, None):  # keys rotated, or only dequantized
            for kv, fn in ((kv_ref, scatter_reference.scatter_rerope), (kv_tri, rope_kernel.scatter_rerope)):
                fn(q8, [kv[l, 0].transpose(1, 2) for l in range(layers)],
                   [kv[l, 1].transpose(1, 2) for l in range(layers)], slots, moved, rope, torch.tensor([2, 0]),
                   scales=sc8)
            if cache_dtype == torch.float16:
                assert torch.equal(kv_tri, kv_ref), (kv_tri.float() - kv_ref.float()).abs().max()
            else:
                torch.testing.assert_close(kv_tri, kv_ref, rtol=2 ** -7, atol=1e-6)
# fp8 blocks -> model-dtype K/V (a layerwise restore's write): every layer of a
# batch, and one layer of a ring buffer viewed as [n, 1, bt, H, D]; with and
# without re-RoPE. fp16: bit-identical; bf16: within 2 ulps (as above).
for neox, rotary_dim, head_dim in [(True, 64, 64), (False, 32, 32), (True, 48, 96)]:
    for out_dtype in (torch.float16, torch.bfloat16):
        n, layers, bt, heads = 3, 2, 8, 3
        q8, sc8, _ = fp8_quantize(torch.randn(n, 2, layers, bt, heads, head_dim) * 3
                                  + torch.randn(heads, head_dim) * 20, token_dim=3)
        inv = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
        rope = RopeSpec(inv, rotary_dim, neox)
        ring = q8[:, :, 1].transpose(0, 1).contiguous()  # layer 1 as a ring buffer holds it
        for deltas in (torch.randint(-100, 100000, (n * bt,)), None):
            for args in ((q8[:, 0], q8[:, 1], sc8), (ring[0].unsqueeze(1), ring[1].unsqueeze(1), sc8[:, :, 1:2])):
                got = rope_dequant.dequantize_rerope(*args, deltas, rope, out_dtype)
                want = dequant_reference.dequantize_rerope(*args, deltas, rope, out_dtype)
                for g, w in zip(got, want):
                    if out_dtype == torch.float16:
                        assert torch.equal(g, w), (g.float() - w.float()).abs().max()
                    else:
                        torch.testing.assert_close(g, w, rtol=2 ** -7, atol=1e-6)
# The rotation kernel: bit-identical to the reference (float32, no fused multiply-adds).
for neox, rotary_dim, head_dim, dtype in [(True, 64, 64, torch.float16), (False, 32, 32, torch.float32),
                                          (True, 48, 96, torch.float16)]:
    inv = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    rope = RopeSpec(inv, rotary_dim, neox)
    keys = torch.randn(3, 21, 5, head_dim).to(dtype)  # [layers, tokens, heads, head_dim]
    deltas = torch.randint(-300000, 300000, (21,))
    for view in (keys[1], keys[:, 3:].transpose(1, 2).contiguous().transpose(1, 2)):  # 3-D; strided 4-D
        got = rope_rotate.rotate_keys(view, deltas[-view.shape[-3]:], rope)
        flat = view if view.dim() == 3 else view.transpose(0, 1).reshape(view.shape[1], -1, head_dim)
        want = rope_reference.rotate_keys(flat, deltas[-view.shape[-3]:], rope)
        if view.dim() == 4:
            want = want.reshape(view.shape[1], view.shape[0], *view.shape[2:]).transpose(0, 1)
        assert torch.equal(got, want), (got - want).abs().max()
    in_place = keys.clone()
    assert rope_rotate.rotate_keys(in_place, deltas, rope, out=in_place) is in_place
    assert torch.equal(in_place, rope_rotate.rotate_keys(keys, deltas, rope))

# The capture gather: paged caches (head-major views here) -> [2, L, n, H, D],
# keys rotated bit-identically to the reference; without deltas a plain copy.
for neox, rotary_dim, head_dim, dtype in [(True, 64, 64, torch.float16), (False, 32, 32, torch.float32),
                                          (True, 48, 96, torch.float16)]:
    inv = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    rope = RopeSpec(inv, rotary_dim, neox)
    layers, heads, pages, page_size, n = 3, 2, 9, 4, 19
    kv = torch.randn(layers, 2, pages, heads, page_size, head_dim).to(dtype)
    k_views = [kv[l, 0].transpose(1, 2) for l in range(layers)]
    v_views = [kv[l, 1].transpose(1, 2) for l in range(layers)]
    slots = torch.randperm(pages * page_size)[:n]
    for deltas in (torch.randint(-300000, 300000, (n,)), None):
        got = rope_gather.gather_rerope(k_views, v_views, slots, deltas, rope,
                                        torch.empty(2, layers, n, heads, head_dim, dtype=dtype))
        want = scatter_reference.gather_rerope(k_views, v_views, slots, deltas, rope,
                                               torch.empty(2, layers, n, heads, head_dim, dtype=dtype))
        assert torch.equal(got, want), (got - want).abs().max()

fused_coarse = coarse_kernel.CoarseConfig(16, 16, 4, 1, num_splits=1)
split_coarse = coarse_kernel.CoarseConfig(16, 16, 4, 1, num_splits=3)
for tokens, q_heads, kv_heads, summaries, head_dim in [(37, 6, 2, 45, 24), (1, 4, 4, 17, 64)]:
    q = torch.randn(tokens, q_heads, head_dim).half()
    out_view = torch.randn(tokens, q_heads, head_dim).half()
    lse_view = torch.randn(tokens, q_heads) * 3
    lse_view[0] = float("-inf")
    k_sum, v_sum = torch.randn(2, summaries, kv_heads, head_dim).half()
    n = torch.randint(0, 20, (summaries,))
    for mask, cfg in ((None, fused_coarse), (torch.rand(tokens, summaries) < 0.5, split_coarse)):
        got = coarse_kernel.coarse_merge(q, out_view, lse_view, k_sum, v_sum, n, mask=mask, config=cfg)
        want = coarse_reference.coarse_merge(q, out_view, lse_view, k_sum, v_sum, n, mask=mask)
        torch.testing.assert_close(got[0], want[0], rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)

# Sub-block (logsumexp) scoring. fp16 / fp32 entries only: the interpreter's
# tl.dot mishandles bfloat16 (bf16 is covered by the GPU test).
sub_tiles = sub_blocks.SubBlockConfig(16, 32, 4, 1, 16, 32, 4, 1, lse_splits=3)
for m, q_heads, kv_heads, s, head_dim, num_slots, b, dtype, cfg in [
    (7, 6, 2, 8, 16, 12, 13, torch.float16, sub_tiles),    # GQA 3, S=8: 4 blocks a tile, 2 splits (of 8 + 5)
    (20, 4, 2, 1, 32, 50, 37, torch.float32, sub_tiles),   # GQA 2, S=1, M > one tile, 2 splits
    (3, 6, 2, 2, 16, 9, 11, torch.float16, None),          # default tiles (clamped), automatic splits
]:
    entries = torch.randn(num_slots, 2, s, kv_heads, head_dim).to(dtype)
    valid = torch.rand(num_slots) < 0.7
    valid[0] = True
    entries[~valid] = float("nan")
    slots = torch.randint(0, num_slots, (b,))  # repeats, any order
    slots[-1] = 0
    q = torch.randn(m, q_heads, head_dim) * 2
    with numpy.errstate(divide="ignore"):  # log2(0) of padded rows and empty candidates
        got = sub_blocks.score_sub_blocks(q, entries, 1, slots, valid, cfg)
        # float32 queries against fp16 entries are split into two fp16 parts: exact to ~1e-7
        want = sub_block_reference.score_sub_blocks_reference(q, entries, 1, slots, valid)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
        assert torch.all(got[:, ~valid[slots]] == 0)
        none = sub_blocks.score_sub_blocks(q, entries, 1, slots, torch.zeros_like(valid), cfg)
        assert torch.all(none == 0), none
assert sub_blocks.score_sub_blocks(q, entries, 0, slots[:0], valid).shape == (q_heads, 0)
assert torch.all(sub_blocks.score_sub_blocks(q[:0], entries, 0, slots, valid) == 0)
print("ok")
